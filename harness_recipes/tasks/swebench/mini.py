"""Make data/swebench/mini.jsonl: Polar's SWE-style instances from real PyPI projects (a maintainer tool).

    python -m harness_recipes.tasks.swebench.mini data/swebench

For each project of data/swebench/mini-projects.toml (load_projects): its sdist (sources/, downloaded
with `pip download --no-binary :all: --no-deps NAME==VERSION`, sha256 recorded in PROVENANCE.md), a
planted bug (bugs/*.patch), the test that catches it (its ``test`` -> ``test_patch``), the fix
(``patch`` = the bug reverted, as a git diff). The repository and its commits come from
sources.py (deterministic); FAIL_TO_PASS / PASS_TO_PASS are measured, not written by
hand: the eval script runs on the buggy and on the fixed tree in the instance's image (the one the
episodes run in: images.py; needs docker), each log read by swebench's pytest parser;
FAIL_TO_PASS = failed before, passed after; PASS_TO_PASS = passed both times.
"""
from __future__ import annotations

import json
import sys
import tempfile
import tomllib
from pathlib import Path

from harness_recipes.docker_engine import docker_client
from harness_recipes.tasks.swebench.images import instance_image
from harness_recipes.tasks.swebench.instances import eval_script_for
from harness_recipes.tasks.swebench.sources import build_repo, git, sha256

PROJECTS_FILE = "mini-projects.toml"  # beside the sources/ and bugs/ it names: projects, bugs, tests, issues
PYPI_SDIST = "https://files.pythonhosted.org/packages/source/{initial}/{package}/{package}-{version}.tar.gz"
PYTEST = "python3 -m pytest -rA -p no:cacheprovider"
FIELDS = {"instance_id", "repo", "package", "version", "bug", "test_file", "test", "problem_statement"}


def load_projects(path: Path) -> list[dict]:
    """The projects of a mini-projects.toml, each with what its fields imply: the sdist under sources/,
    its PyPI URL, the bug patch under bugs/ and the test command."""
    try:
        projects = tomllib.loads(Path(path).read_text())["project"]
    except (OSError, tomllib.TOMLDecodeError, KeyError) as e:
        raise SystemExit(f"{path}: cannot read the projects ([[project]] tables): {type(e).__name__}: {e}") from None
    out = []
    for n, p in enumerate(projects, 1):
        missing = FIELDS - set(p)
        if missing:
            raise SystemExit(f"{path}: project {n} ({p.get('instance_id', '?')}) lacks {sorted(missing)}")
        pkg, version = p["package"], p["version"]
        out.append({**p, "sdist": f"sources/{pkg}-{version}.tar.gz", "bug_patch": f"bugs/{p['bug']}.patch",
                    "url": PYPI_SDIST.format(initial=pkg[0], package=pkg, version=version),
                    "test_cmd": " ".join(filter(None, (p.get("test_env"), PYTEST, p["test_file"])))})
    return out


def _status(container, inst: dict) -> dict[str, str]:
    """The test statuses of one run of the eval script in the instance's container (swebench's parser)."""
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
    from swebench.harness.log_parsers.python import parse_log_pytest
    # One stream, as the graders read it: the markers come from `set -x` on stderr, the tests on stdout.
    res = container.exec_run(["bash", "-c", inst["eval_script"] + "\n", "eval"], workdir="/testbed")
    log = res.output.decode(errors="replace")
    if START_TEST_OUTPUT not in log:
        raise SystemExit(f"{inst['instance_id']}: the eval script did not reach the tests:\n{log[-2000:]}")
    return parse_log_pytest(log.split(START_TEST_OUTPUT)[1].split(END_TEST_OUTPUT)[0], None)


def _measure(client, inst: dict, repo: Path) -> tuple[dict, dict]:
    """Statuses on the buggy tree and on the fixed tree, in the image the episodes use."""
    image, _ = instance_image(client, inst, repo, log=print)
    c = client.containers.run(image, ["sleep", "infinity"], detach=True, network_mode="none", init=True)
    try:
        before = _status(c, inst)
        c.exec_run(["bash", "-c", f"git apply - <<'EOF_POLAR'\n{inst['patch']}\nEOF_POLAR"], workdir="/testbed")
        after = _status(c, inst)
    finally:
        c.remove(force=True)
    return before, after


def make(outdir: Path) -> list[dict]:
    client = docker_client()
    rows = []
    for p in load_projects(outdir / PROJECTS_FILE):
        src = {"sdist": p["sdist"], "sha256": sha256(outdir / p["sdist"]), "url": p["url"], "bug_patch": p["bug_patch"]}
        inst = {"instance_id": p["instance_id"], "repo": p["repo"], "version": p["version"], "polar_source": src}
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp) / "repo"
            setup, base = build_repo(inst, outdir, repo)
            fix = git(["diff", base, setup], repo) + "\n"
            with open(repo / p["test_file"], "a") as f:
                f.write(p["test"])
            test_patch = git(["diff"], repo) + "\n"
            git(["checkout", "-q", "--", "."], repo)
            inst.update(base_commit=base, environment_setup_commit=setup, patch=fix, test_patch=test_patch,
                        problem_statement=p["problem_statement"], hints_text="", created_at="2026-12-02T00:00:00Z",
                        test_cmd=p["test_cmd"], log_parser="parse_log_pytest", eval_type="pass_and_fail")
            inst["eval_script"] = eval_script_for(inst)
            before, after = _measure(client, inst, repo)
        f2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) in ("FAILED", "ERROR"))
        p2p = sorted(t for t, s in after.items() if s == "PASSED" and before.get(t) == "PASSED")
        if not f2p or any(s != "PASSED" for s in after.values() if s not in ("SKIPPED", "XFAIL")):
            raise SystemExit(f"{p['instance_id']}: the fix does not make the tests pass: {after}")
        inst.update(FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p)
        rows.append(inst)
    return rows


def main() -> None:
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else "data/swebench")
    rows = make(outdir)
    with open(outdir / "mini.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    for r in rows:
        print(f"{r['instance_id']}: base {r['base_commit'][:12]}, FAIL_TO_PASS {len(r['FAIL_TO_PASS'])}, "
              f"PASS_TO_PASS {len(r['PASS_TO_PASS'])}")


if __name__ == "__main__":
    main()
