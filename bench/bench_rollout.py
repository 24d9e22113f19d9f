"""The rollout pipeline: episodes/s and server-slot utilization, pipelined versus sequential.

    .venv/bin/python bench/bench_rollout.py                  # 8 episodes x 3 modes with Pi, a few minutes
    .venv/bin/python bench/bench_rollout.py --episodes 4     # quicker
    .venv/bin/python bench/bench_rollout.py --runtime docker # container start as the prewarm cost

Same real stack as the demo: polar-serve (scripted) <- mitmdump + Polar addon <- a real harness CLI
(Pi by default) run by polar-rollout on copies of the fix-add task. Harness runs are of varied
length: the script gives each task its own generation delays (0.5-4 s a turn; polar-serve holds its
slot while it "generates"), and the evaluation costs `--eval-seconds` more (a real test suite).

Modes, on the same tasks, one after the other:
- sequential: one episode through prewarm, run, eval, recon before the next starts;
- pipelined-1: one harness at a time, but the next workspace is prewarmed and the last one
  evaluated while it runs;
- pipelined-N: N harnesses at once (--concurrency), plus prewarm/eval overlap.

Server-slot utilization = the union of the intervals in which polar-serve was answering a call
(t_start..t_end of every captured call, from the logs) divided by the rollout's wall time.
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
os.environ.setdefault("POLAR_CACHE", str(BENCH.parent / ".cache"))  # the checkout's cache (harnesses), as make

from harness_recipes.node.local_stack import capture_proxy, serve  # noqa: E402
from polar_contracts.assets import data_path  # noqa: E402

SHELL = {"any_of": ["run_shell_command", "bash", "shell", "exec_command", "Bash"]}
DELAYS = [0.5, 3.0, 1.0, 2.0, 4.0, 0.5, 1.5, 2.5]  # seconds per generating turn, per task


def make_workload(d: Path, n: int, eval_seconds: float) -> tuple[Path, Path]:
    repo = data_path("tasks", "repos", "fix_add")
    tasks, rules = [], [{"when": {"tools": False}, "reply": {"content": "Fix the failing test"}}]
    for k in range(n):
        tag, delay = f"bench-{k:02d}", DELAYS[k % len(DELAYS)]
        tasks.append({"id": tag, "workspace": str(repo), "timeout": 600, "eval_timeout": 120 + eval_seconds,
                      "prompt": f"[{tag}] The test in test_calc.py fails. Fix calc.py. Do not change the test.",
                      "eval": f"sleep {eval_seconds} && git checkout -q HEAD -- test_calc.py "
                              "&& python3 -m unittest -q test_calc"})
        fix = "sed -i 's/return a - b/return a + b/' calc.py"
        for turn, (cmd, dl) in enumerate([(fix, delay), ("python3 -m unittest -q test_calc", delay / 2)]):
            args = {"command": cmd}
            rules.append({"when": {"last_user_contains": tag, "turn": turn},
                          "reply": {"content": "Working on it.", "delay": dl, "tool_calls": [
                              {"tool": SHELL, "arguments": args, "arguments_by_tool": {
                                  "run_shell_command": {**args, "description": "step", "is_background": False}}}]}})
    script = {"rules": rules, "turns": [], "fallback": {"content": "Done.", "delay": 0.3}}
    (d / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (d / "script.json").write_text(json.dumps(script))
    return d / "tasks.jsonl", d / "script.json"


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def measure(out: Path, logdir: Path) -> dict:
    from polar_contracts.log.reader import read_episode
    recs = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    start = min(r["phases"]["prewarm"][0] for r in recs)
    end = max(r["finished_at"] for r in recs)
    intervals = []
    for r in recs:
        calls = read_episode(logdir / f"{r['episode_id']}.arrow").calls
        intervals += [(a, b) for a, b in zip(calls["t_start"].to_list(), calls["t_end"].to_list()) if a and b]
    wall = end - start
    return {"episodes": len(recs), "ok": sum(r["status"] == "done" and r["reward"] == 1.0 for r in recs),
            "wall_s": round(wall, 2), "episodes_per_s": round(len(recs) / wall, 4),
            "server_busy_s": round(busy_seconds(intervals), 2),
            "server_utilization": round(busy_seconds(intervals) / wall, 3), "calls": len(intervals)}


def run_mode(name: str, extra: list[str], args, tasks: Path, proxy: str, base: Path) -> dict:
    out, logdir = base / name / "out", base / name / "logs"
    cmd = [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", args.harness, "--tasks", str(tasks),
           "--proxy", proxy, "--logdir", str(logdir), "--out", str(out), "--runtime", args.runtime,
           "--recon", "none", "--no-progress", *extra]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: polar-rollout failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = measure(out, logdir)
    res["command_s"] = round(time.monotonic() - t0, 2)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", default="pi")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--eval-seconds", type=float, default=1.0)
    ap.add_argument("--runtime", choices=["local", "docker"], default="local")
    ap.add_argument("--json", type=Path, default=BENCH / "results" / "rollout.json")
    args = ap.parse_args()
    from harness_recipes.cache import tiny_model
    from harness_recipes.recipes.install import ensure_installed
    from harness_recipes.recipes.recipe import load_recipe
    ensure_installed(load_recipe(args.harness))
    base = Path(tempfile.mkdtemp(prefix="polar-bench-rollout-"))
    try:
        tasks, script = make_workload(base, args.episodes, args.eval_seconds)
        # Each mode gets its own proxy logdir but the same server (one slot, like one GPU engine).
        modes = [("sequential", ["--sequential"]),
                 ("pipelined-1", ["--concurrency", "1", "--prewarm", "2", "--eval-concurrency", "2"]),
                 (f"pipelined-{args.concurrency}", ["--concurrency", str(args.concurrency), "--prewarm", "2",
                                                    "--eval-concurrency", "2"])]
        results = {}
        with serve(tiny_model(), script=script) as srv:
            for name, extra in modes:
                with capture_proxy(srv.url, base / name / "logs") as proxy:
                    secret = ["--control-secret-file", str(proxy.secret_file)]
                    results[name] = run_mode(name, [*extra, *secret], args, tasks, proxy.url, base)
                print(f"{name:14} {results[name]}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    seq = results["sequential"]
    print(f"\n{'mode':14} {'episodes/s':>11} {'server util':>12} {'wall s':>8} {'speedup':>8}")
    for name, r in results.items():
        print(f"{name:14} {r['episodes_per_s']:>11.4f} {r['server_utilization']:>12.1%} {r['wall_s']:>8.1f} "
              f"{r['episodes_per_s'] / seq['episodes_per_s']:>7.2f}x")
    report = {"harness": args.harness, "runtime": args.runtime, "episodes": args.episodes,
              "eval_seconds": args.eval_seconds, "delays_per_turn_s": DELAYS[: args.episodes], "modes": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
