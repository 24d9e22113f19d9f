"""SWE-bench episodes on the docker runtime: what prewarm (image build + container start) costs, and
how much of it the pipeline hides behind running episodes.

    .venv/bin/python bench/bench_swebench.py               # 3 instances x 2 samples x 3 modes, a few minutes
    .venv/bin/python bench/bench_swebench.py --samples 1   # quicker

The real stack of tests/rollout/test_swebench_e2e.py: polar-serve (scripted by
data/swebench/scripts/mini.json, each reply held `--delay` seconds as if generating) <- mitmdump +
Polar addon <- the real Codex CLI, run by polar-rollout in each instance's image
(data/swebench/mini.jsonl), graded by swebench. Before each mode the instance images are removed
(the Debian base stays: it is built once per machine), so every mode pays the same image builds:
"cold" prewarm.

Modes, on the same instances, one after the other:
- sequential: one episode through prewarm (image build or lookup, container start), run, eval,
  recon before the next starts (the baseline);
- pipelined-1: one harness at a time, the next episodes' images built and containers started while
  it runs (--prewarm 2);
- pipelined-2: two harnesses at a time, plus the same prewarm overlap.

Reported per mode: wall time, episodes/s, the summed prewarm seconds, and the prewarm seconds that
overlapped another episode's run phase (hidden by the pipeline).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
os.environ.setdefault("POLAR_CACHE", str(ROOT / ".cache"))  # the checkout's cache (harnesses), as make

from harness_recipes.node.local_stack import capture_proxy, serve  # noqa: E402

MINI = ROOT / "data" / "swebench" / "mini.jsonl"
SCRIPT = ROOT / "data" / "swebench" / "scripts" / "mini.json"


def slow_script(d: Path, delay: float) -> Path:
    s = json.loads(SCRIPT.read_text())
    for r in s["rules"]:
        r["reply"]["delay"] = delay
    s["fallback"]["delay"] = delay
    p = d / "script.json"
    p.write_text(json.dumps(s))
    return p


def remove_instance_images() -> int:
    from harness_recipes.docker_engine import docker_client
    client = docker_client()
    n = 0
    for img in client.images.list(filters={"label": "polar.swebench.instance"}):
        client.images.remove(img.id, force=True)
        n += 1
    return n


def overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    """Seconds of interval a covered by the union of spans."""
    pts = sorted((max(a[0], s), min(a[1], e)) for s, e in spans if min(a[1], e) > max(a[0], s))
    total, end = 0.0, float("-inf")
    for s, e in pts:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def measure(out: Path) -> dict:
    recs = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    start = min(r["phases"]["prewarm"][0] for r in recs)
    wall = max(r["finished_at"] for r in recs) - start
    prewarm = hidden = 0.0
    for r in recs:
        p = tuple(r["phases"]["prewarm"])
        prewarm += p[1] - p[0]
        others = [tuple(o["phases"]["run"]) for o in recs if o is not r and "run" in o["phases"]]
        hidden += overlap(p, others)
    return {"episodes": len(recs), "resolved": sum(r.get("swebench", {}).get("resolved") is True for r in recs),
            "statuses": sorted({r["status"] for r in recs}), "wall_s": round(wall, 2),
            "episodes_per_s": round(len(recs) / wall, 4), "prewarm_s": round(prewarm, 2),
            "prewarm_hidden_s": round(hidden, 2)}


def run_mode(name: str, extra: list[str], args, proxy: str, base: Path) -> dict:
    removed = remove_instance_images()
    out, logdir = base / name / "out", base / name / "logs"
    cmd = [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", "codex", "--tasks", f"swebench:{MINI}",
           "--samples", str(args.samples), "--runtime", "docker", "--proxy", proxy, "--logdir", str(logdir),
           "--out", str(out), "--recon", "none", "--no-progress", *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: polar-rollout failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = measure(out)
    res.update(command_s=round(time.monotonic() - t0, 2), images_removed_before=removed)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--delay", type=float, default=1.5, help="seconds each scripted reply 'generates'")
    ap.add_argument("--json", type=Path, default=BENCH / "results" / "swebench.json")
    args = ap.parse_args()
    from harness_recipes.cache import tiny_model
    from harness_recipes.docker_engine import docker_client
    from harness_recipes.recipes.install import ensure_installed
    from harness_recipes.recipes.recipe import load_recipe
    from harness_recipes.tasks.swebench.images import ensure_base
    ensure_installed(load_recipe("codex"))
    ensure_base(docker_client(), log=print)  # the Debian base: once per machine, not part of any mode
    base = Path(tempfile.mkdtemp(prefix="polar-bench-swebench-"))
    try:
        script = slow_script(base, args.delay)
        modes = [("sequential", ["--sequential"]),
                 ("pipelined-1", ["--concurrency", "1", "--prewarm", "2", "--eval-concurrency", "2"]),
                 ("pipelined-2", ["--concurrency", "2", "--prewarm", "2", "--eval-concurrency", "2"])]
        results = {}
        with serve(tiny_model(), script=script) as srv:
            for name, extra in modes:
                with capture_proxy(srv.url, base / name / "logs") as proxy:
                    secret = ["--control-secret-file", str(proxy.secret_file)]
                    results[name] = run_mode(name, [*extra, *secret], args, proxy.url, base)
                print(f"{name:12} {results[name]}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    seq = results["sequential"]
    print(f"\n{'mode':12} {'episodes/s':>11} {'wall s':>8} {'prewarm s':>10} {'hidden':>8} {'speedup':>8}")
    for name, r in results.items():
        print(f"{name:12} {r['episodes_per_s']:>11.4f} {r['wall_s']:>8.1f} {r['prewarm_s']:>10.1f} "
              f"{r['prewarm_hidden_s'] / max(r['prewarm_s'], 1e-9):>7.0%} "
              f"{r['episodes_per_s'] / seq['episodes_per_s']:>7.2f}x")
    report = {"samples": args.samples, "delay_s": args.delay, "instances": 3, "modes": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
