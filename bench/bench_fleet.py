"""The fleet's overhead: episodes/s and p50 episode latency of `polar-rollout fleet` on 1, 2, 3 Ray
nodes vs plain `polar-rollout run` on the same tasks, and the time from an episode's end to its
shard row being readable by the trainer.

    PYTHONPATH=. .venv/bin/python bench/bench_fleet.py                 # 16 tasks x 2 samples, 2 passes, ~8 min
    PYTHONPATH=. .venv/bin/python bench/bench_fleet.py --tasks 8 --repeat 1   # quicker

Workload (the same for every mode): copies of the fix-add task, GRPO groups of --samples; each
episode a fast harness (tests/rollout/fake_harness.py: --calls streamed chat calls through a capture
proxy, then it fixes calc.py; the evaluation runs the real unittest) in front of a scripted
polar-serve whose every reply takes --delay s (a timer, so concurrent calls overlap, like a GPU
engine's batch). Every mode runs --concurrency harnesses at once per node, --prewarm 2, one capture
proxy per node, isolation none.

- run: `polar-rollout run --proxy` with one mitmdump, `--recon none` (its own logs dir).
- fleet-N: `polar-rollout fleet --local N` (N Ray nodes on this machine, ray.cluster_utils), the
  store a local file:// directory, its one `polar-recon watch` building <store>/shards.

Episodes/s: episodes / (last episode's finished_at - first episode's prewarm start), from the
rollout records (the same fields in both modes); the command's own wall time (Ray start and stop,
the final recon) is reported beside it. Episode latency: finished_at - prewarm start of each.
Shard latency (fleet modes): this process polls <store>/shards every 50 ms as a trainer would
(listing, reading the new files' episode_id column) and records when each episode's row is first
readable; latency = that moment - the episode's finished_at (its evaluation done, its record
about to be published). A group's rows are written together, so an episode waits for the last of
its group too: that part is reported separately (group_wait).

Every node shares this machine's cores with the others, the server and this process: with N nodes
on one 2-core host the fleet measures its overhead, not its scaling.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
os.environ.setdefault("POLAR_CACHE", str(ROOT / ".cache"))

FAKE = ROOT / "tests" / "rollout" / "fake_harness.py"


def recipe(d: Path, calls: int) -> Path:
    """The fake harness's recipe (tests/rollout/fake_harness.toml, read as data), episodes named in the path."""
    argv = [str(FAKE), "chat", str(calls), "fix", "calc.py", "return a - b", "return a + b"]
    p = d / "benchfleet.toml"
    p.write_text(FAKE.with_suffix(".toml").read_text().replace("@NAME@", "benchfleet").replace("@BIN@", sys.executable)
                 .replace("@VIA@", "path").replace("@ARGV@", ", ".join(json.dumps(a) for a in argv)))
    return p


def workload(d: Path, n: int, delay: float) -> tuple[Path, Path]:
    from polar_contracts.assets import data_path
    repo = data_path("tasks", "repos", "fix_add")
    tasks = [{"id": f"add{i}", "workspace": str(repo), "prompt": "fix calc.py", "timeout": 120, "eval_timeout": 60,
              "eval": "git checkout -q HEAD -- test_calc.py && python3 -m unittest -q test_calc"} for i in range(n)]
    (d / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    (d / "script.json").write_text(json.dumps({"turns": [], "rules": [],
                                               "fallback": {"content": "Looking at calc.py.", "delay": delay}}))
    return d / "tasks.jsonl", d / "script.json"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(recs: list[dict], command_s: float) -> dict:
    start = min(r["phases"]["prewarm"][0] for r in recs)
    end = max(r["finished_at"] for r in recs)
    lat = [r["finished_at"] - r["phases"]["prewarm"][0] for r in recs]
    return {"episodes": len(recs), "ok": sum(r["status"] == "done" and r["reward"] == 1.0 for r in recs),
            "wall_s": round(end - start, 2), "episodes_per_s": round(len(recs) / (end - start), 3),
            "p50_latency_s": round(statistics.median(lat), 3), "p90_latency_s": round(pct(lat, 0.9), 3),
            "command_s": round(command_s, 2), "nodes": len({r.get("node", "run") for r in recs})}


def rollout_cmd(args, tasks: Path, rec: Path, model: str) -> list[str]:
    """The options `run` and `fleet` share."""
    return ["--recipe", str(rec), "--tasks", str(tasks), "--samples", str(args.samples), "--model", model,
        "--concurrency", str(args.concurrency), "--prewarm", "2", "--isolation", "none", "--no-progress"]


def run_plain(args, tasks, rec, model, server_url, base: Path) -> dict:
    """`polar-rollout run` through one capture proxy (the baseline)."""
    from harness_recipes.node.local_stack import capture_proxy
    logdir, out = base / "run" / "logs", base / "run" / "out"
    with capture_proxy(server_url, logdir) as proxy:
        cmd = [sys.executable, "-m", "harness_recipes.cli", "run", *rollout_cmd(args, tasks, rec, model),
               "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir),
               "--out", str(out), "--recon", "none"]
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
        took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    recs = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    return summarize(recs, took)


class ShardWatcher:
    """Polls <store>/shards as a trainer would; the first moment each episode's row is readable."""

    def __init__(self, shards: Path, every: float = 0.05):
        self.shards, self.every = shards, every
        self.seen: dict[str, float] = {}
        self.files: set[str] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import pyarrow.parquet as pq
        while not self.stop.is_set():
            for f in sorted(self.shards.glob("shard-*.parquet")) if self.shards.is_dir() else []:
                if f.name in self.files:
                    continue
                now = time.time()
                try:
                    eids = pq.read_table(f, columns=["episode_id"]).column("episode_id").to_pylist()
                except (OSError, ValueError):
                    continue  # (not there in full yet: recon writes temp + rename, so this should not happen)
                self.files.add(f.name)
                for e in eids:
                    self.seen.setdefault(e, now)
            time.sleep(self.every)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(3 * self.every)
        self.stop.set()
        self.thread.join()


def run_fleet(args, n: int, tasks, rec, model, server_url, base: Path) -> dict:
    from harness_recipes.fleet.store import Store
    store_dir = base / f"fleet-{n}" / "store"
    cmd = [sys.executable, "-m", "harness_recipes.cli", "fleet", *rollout_cmd(args, tasks, rec, model),
           "--server", server_url, "--store", f"file://{store_dir}", "--local", str(n), "--proxies-per-node", "1",
           "--node-dir", str(base / f"fleet-{n}" / "nodes")]
    with ShardWatcher(store_dir / "shards") as watch:
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
        took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"fleet-{n} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    recs = Store(f"file://{store_dir}").records()
    res = summarize(recs, took)
    missing = [r["episode_id"] for r in recs if r["episode_id"] not in watch.seen]
    if missing:
        raise SystemExit(f"fleet-{n}: {len(missing)} episodes never reached a shard: {missing[:5]}")
    group_end = {}
    for r in recs:
        group_end[r["task_id"]] = max(group_end.get(r["task_id"], 0.0), r["finished_at"])
    shard = [watch.seen[r["episode_id"]] - r["finished_at"] for r in recs]
    after_group = [watch.seen[r["episode_id"]] - group_end[r["task_id"]] for r in recs]
    wait = [group_end[r["task_id"]] - r["finished_at"] for r in recs]
    res.update(shard_p50_s=round(statistics.median(shard), 3), shard_max_s=round(max(shard), 3),
               after_group_p50_s=round(statistics.median(after_group), 3),
               after_group_max_s=round(max(after_group), 3), group_wait_p50_s=round(statistics.median(wait), 3),
               shard_files=len(watch.files))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--calls", type=int, default=2, help="chat calls per episode")
    ap.add_argument("--delay", type=float, default=0.5, help="seconds each reply takes (scripted server)")
    ap.add_argument("--concurrency", type=int, default=2, help="harness runs at once per node")
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--repeat", type=int, default=2, help="passes over the modes (medians reported)")
    ap.add_argument("--json", type=Path, default=BENCH / "results" / "fleet.json")
    args = ap.parse_args()
    from harness_recipes.cache import tiny_model
    from harness_recipes.node.local_stack import serve

    base = Path(tempfile.mkdtemp(prefix="polar-bench-fleet-"))
    results = {}
    try:
        tasks, script = workload(base, args.tasks, args.delay)
        rec = recipe(base, args.calls)
        modes = ["run"] + [f"fleet-{int(x)}" for x in args.nodes.split(",")]
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        with serve(tiny_model(), script=script) as srv:
            import httpx
            model = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]
            for rep in range(args.repeat):  # every other pass in reverse order: drift in the machine's load evens out
                for m in (modes if rep % 2 == 0 else modes[::-1]):
                    run_dir = base / f"pass{rep}"
                    r = (run_plain(args, tasks, rec, model, srv.url, run_dir) if m == "run" else
                         run_fleet(args, int(m.split("-")[1]), tasks, rec, model, srv.url, run_dir))
                    runs[m].append(r)
                    print(f"pass {rep} {m:8} {r}", flush=True)
                    shutil.rmtree(run_dir, ignore_errors=True)
        for m, rs in runs.items():  # the median of the passes, per number
            results[m] = {k: (statistics.median(r[k] for r in rs) if isinstance(rs[0][k], (int, float)) else rs[0][k])
                          for k in rs[0]}
            results[m]["passes"] = rs
    finally:
        shutil.rmtree(base, ignore_errors=True)
    r0 = results["run"]
    print(f"\n{'mode':8} {'episodes/s':>10} {'vs run':>7} {'p50 lat s':>10} {'vs run':>7} {'command s':>10} "
          f"{'shard p50 s':>11} {'shard max s':>11} {'after group p50':>15}")
    for name, r in results.items():
        print(f"{name:8} {r['episodes_per_s']:>10.3f} {r['episodes_per_s'] / r0['episodes_per_s']:>6.2f}x "
              f"{r['p50_latency_s']:>10.2f} {r['p50_latency_s'] / r0['p50_latency_s']:>6.2f}x {r['command_s']:>10.1f} "
              f"{r.get('shard_p50_s', float('nan')):>11.2f} {r.get('shard_max_s', float('nan')):>11.2f} "
              f"{r.get('after_group_p50_s', float('nan')):>15.2f}")
    report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "cores": os.cpu_count(), "modes": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
