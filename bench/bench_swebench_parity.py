"""SWE-bench Verified parity: real rows of several repositories, each graded gold -> resolved and
no change -> unresolved by swebench's own parser for its repository, in images built here.

    .venv/bin/python bench/bench_swebench_parity.py                      # the rows of data/swebench-verified
    .venv/bin/python bench/bench_swebench_parity.py --instances ID,ID --repos DIR   # others, your clones
    .venv/bin/python bench/bench_swebench_parity.py --json out.json

Per row: the image is built as `polar-rollout run` builds it (tasks/swebench/images.py: the Debian
base of the spec's Python, the packages resolved by pip inside that root as of RESOLVED_BEFORE,
/testbed at base_commit), then twice, each in a fresh container (`--network none`): the patch (the
row's gold patch, or none) applied with `git apply`, the row's own eval script run (its conda
activation swapped for the venv's, eval_script.script_for) and its log graded by swebench's
get_eval_report, whose parser is the one the row names (`log_parser`). The agent is left out: what
is measured is the environment and the grading. Reported per row: both verdicts, the tests each
verdict rests on, the image build time and size, and where a verdict differs from the published
one (gold resolves, no change does not), the tests that differ.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
os.environ.setdefault("POLAR_CACHE", str(ROOT / ".cache"))  # the checkout's cache, as make

VERIFIED = ROOT / "data" / "swebench-verified" / "SWE-bench_Verified-test.parquet"
REPOS = ROOT / "data" / "swebench-verified" / "repos"
ROWS = ("psf__requests-5414", "pytest-dev__pytest-7432", "sympy__sympy-12481", "pylint-dev__pylint-4970",
        "sphinx-doc__sphinx-8721", "mwaskom__seaborn-3069", "django__django-15863")


def _put(container, path: str, text: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        data = text.encode()
        info = tarfile.TarInfo(Path(path).name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    container.put_archive(str(Path(path).parent), buf.getvalue())


def evaluate(client, inst: dict, image: str, patch: str, timeout: float) -> tuple[dict, float]:
    """swebench's report for `patch` (may be "") on a fresh container of `image`, and the eval seconds."""
    from harness_recipes.docker_engine import exec_wait
    from harness_recipes.tasks.swebench.eval_script import script_for
    from harness_recipes.tasks.swebench.grade import grade_log
    script = script_for(inst, "built")
    c = client.containers.run(image, ["sleep", "infinity"], detach=True, network_mode="none")
    try:
        t0 = time.monotonic()
        if patch:
            _put(c, "/tmp/model.patch", patch)
            rc, (out, err) = exec_wait(c, ["git", "apply", "-v", "/tmp/model.patch"], workdir="/testbed")
            if rc != 0:
                raise RuntimeError(f"{inst['instance_id']}: the patch does not apply: {((out or b'') + (err or b''))[-400:]!r}")
        _put(c, "/tmp/eval.sh", script)
        res = c.exec_run(["timeout", str(int(timeout)), "bash", "-c", "bash /tmp/eval.sh 2>&1"], workdir="/testbed")
        secs = time.monotonic() - t0
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False, encoding="utf-8") as f:
            f.write(res.output.decode(errors="replace"))  # as grade.py (and swebench's harness) keep it
            log = f.name
        report = grade_log(inst, patch, Path(log), script)
        report["log"] = log
        return report, secs
    finally:
        c.remove(force=True)


def _counts(report: dict) -> dict:
    tests = report.get("tests_status", {})
    return {k: {"success": len(v.get("success", [])), "failure": v.get("failure", [])} for k, v in tests.items()
            if k in ("FAIL_TO_PASS", "PASS_TO_PASS")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", default=",".join(ROWS))
    ap.add_argument("--rows", default=str(VERIFIED), help="the rows (swebench: JSONL / Parquet)")
    ap.add_argument("--repos", default=str(REPOS))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--json", default=None, help="write the results here too")
    args = ap.parse_args()
    from harness_recipes.docker_engine import docker_client
    from harness_recipes.tasks.swebench.images import instance_image
    from harness_recipes.tasks.swebench.instances import load_instances
    client = docker_client(timeout=args.timeout + 120)  # one exec runs a whole eval
    tasks = load_instances(f"swebench:{args.rows}", repos=args.repos, instances=args.instances.split(","))
    results = []
    for t in tasks:
        inst = t.swebench
        iid = inst["instance_id"]
        row = {"instance_id": iid, "repo": inst["repo"], "version": inst["version"],
               "log_parser": inst.get("log_parser", "")}
        try:
            t0 = time.monotonic()
            image, how = instance_image(client, inst, t.git_repo, lambda m: print(f"  {m}", flush=True),
                                        Path(args.repos))
            row.update(image=image, how=how, build_s=round(time.monotonic() - t0, 1),
                       image_mb=round(client.images.get(image).attrs["Size"] / 1e6))
            for name, patch in (("gold", inst["patch"]), ("none", "")):
                report, secs = evaluate(client, inst, image, patch, args.timeout)
                row[name] = {"resolved": bool(report.get("resolved")), "eval_s": round(secs, 1),
                             "tests": _counts(report), "log": report["log"]}
            row["matches"] = row["gold"]["resolved"] is True and row["none"]["resolved"] is False
        except Exception as e:  # one row's failure is a result too; the others still run
            row["error"] = f"{type(e).__name__}: {e}"[-2000:]
        results.append(row)
        print(json.dumps(row), flush=True)
    print("\n| row | parser | gold | no change | image build s | image MB | eval s (gold) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['instance_id']} | {r['log_parser']} | error: {r['error'][:120]} | | | | |")
            continue
        g, n = r["gold"], r["none"]
        print(f"| {r['instance_id']} | {r['log_parser']} | {'resolved' if g['resolved'] else 'NOT resolved'} | "
              f"{'resolved' if n['resolved'] else 'unresolved'} | {r['build_s']} | {r['image_mb']} | {g['eval_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r.get("matches") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
