"""Benchmark: `polar-recon compare` against merely reading the same shards with pyarrow.

    .venv/bin/python bench/bench_compare.py --from runs/cmp                     # 200,000 episodes
    .venv/bin/python bench/bench_compare.py --from runs/cmp --harness pi        # one harness's rows only
    .venv/bin/python bench/bench_compare.py --from runs/cmp --episodes 2000 --json

A large store synthesized from REAL shard rows: every harness store under --from (any compare
input: an experiment root, a store, a rollout output) has its rows and rollout records replicated
(new episode and group ids, rewards drawn per copy, eight weight versions) until the experiment
holds --episodes episodes, split evenly between the harnesses, 256 rows a shard, one store per
harness (the layout `polar-rollout fleet` writes per recipe). Logs are not replicated: at this
scale the report runs on shards + records (log-level numbers need the logs, one file per episode).

Measured side by side in this process, alternating, --repeat times each (median kept), after one
untimed read to warm the page cache: the floor (pyarrow.parquet.read_table of every shard, all
columns; then only the columns the report reads) and the report (compare's loading and
aggregation; then the same with the HTML page).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from polar_recon.compare.frames import SHARD_COLS
from polar_recon.compare.frames import records as read_records
from polar_recon.compare.run import run_compare
from polar_recon.compare.sources import resolve

ROWS_PER_SHARD = 256
VERSIONS = 8


def synthesize(src: str, out: Path, episodes: int, seed: int = 0, only: tuple[str, ...] = ()) -> dict:
    """Replicate the real rows of every harness of ``src`` (or those in ``only``) into
    out/<harness>/ (shards + records)."""
    rng = np.random.default_rng(seed)
    sources = [s for s in resolve([src]) if s.shards and (not only or s.name in only)]
    if not sources:
        raise SystemExit(f"{src}: no shards to replicate")
    per = episodes // len(sources)
    info = {}
    for s in sources:
        t = pa.concat_tables(pq.read_table(p) for p in s.shards)
        eids = t["episode_id"].to_numpy(zero_copy_only=False)
        real = list(dict.fromkeys(eids))
        copies = math.ceil(per / len(real))
        # rows of one copy of every real episode, then the copy number of each output row
        idx = np.tile(np.arange(t.num_rows), copies)
        copy = np.repeat(np.arange(copies), t.num_rows)
        keep = np.repeat(np.arange(copies) * len(real), t.num_rows) + np.tile(
            np.array([real.index(e) for e in eids]), copies) < per
        idx, copy = idx[keep], copy[keep]
        big = t.take(pa.array(idx))
        suffix = np.char.add(".x", copy.astype(str))
        new_eid = np.char.add(eids[idx].astype(str), suffix)
        p_solve = 0.3 + 0.4 * rng.random()  # a harness's own solve rate
        ep_reward = (rng.random(copies * len(real)) < p_solve).astype(np.float64)
        reward = ep_reward[copy * len(real) + np.array([real.index(e) for e in eids])[idx]]
        gids = t["group_id"].to_numpy(zero_copy_only=False)[idx].astype(str)
        cols = {"episode_id": pa.array(new_eid), "group_id": pa.array(np.char.add(gids, suffix)),
                "reward": pa.array(reward), "weight_version": pa.array(np.char.add("v", (copy * VERSIONS // copies).astype(str)))}
        for name, arr in cols.items():
            big = big.set_column(big.schema.get_field_index(name), name, arr)
        dest = out / s.name
        (dest / "shards").mkdir(parents=True)
        for k in range(0, big.num_rows, ROWS_PER_SHARD):
            pq.write_table(big.slice(k, ROWS_PER_SHARD), dest / "shards" / f"shard-{k // ROWS_PER_SHARD:06d}.parquet")
        # the rollout records, one line per episode (as episodes.jsonl), with the replicated ids and rewards
        recs = read_records([s])
        by_id = {r["episode_id"]: r for r in recs.to_dicts()}
        lines = []
        for c in range(copies):
            for j, e in enumerate(real):
                if c * len(real) + j >= per:
                    break
                r = dict(by_id.get(e) or {"episode_id": e, "status": "done"})
                phases = {p: [0.0, r.get(f"{p}_s") or 0.0] for p in ("prewarm", "run", "eval", "recon")}
                lines.append(json.dumps({"episode_id": f"{e}.x{c}", "harness": r.get("harness") or s.name,
                                         "status": r.get("status"), "reward": float(ep_reward[c * len(real) + j]),
                                         "phases": phases, "task_id": e, "sample": c}))
        (dest / "rollout").mkdir()
        (dest / "rollout" / "episodes.jsonl").write_text("\n".join(lines) + "\n")
        info[s.name] = {"episodes": per, "rows": big.num_rows, "real_episodes": len(real),
                        "tokens": int(pa.compute.sum(pa.compute.list_value_length(big["input_ids"])).as_py())}
    return info


def _floor(root: Path, columns: list[str] | None = None) -> float:
    t0 = time.perf_counter()
    for p in sorted(root.glob("*/shards/shard-*.parquet")):
        pq.read_table(p, columns=columns)
    return time.perf_counter() - t0


# the shard columns the report reads (frames.SHARD_COLS and loss_mask): the second, tighter floor
REPORT_COLUMNS = [*SHARD_COLS, "loss_mask"]


def _report(root: Path, html: Path | None) -> float:
    t0 = time.perf_counter()
    run_compare([str(root)], [], [], html_path=str(html) if html else None, max_views=0)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", required=True, help="a compare input with real shards (e.g. runs/cmp)")
    ap.add_argument("--episodes", type=int, default=200_000)
    ap.add_argument("--harness", action="append", default=[],
                    help="replicate only this harness of --from (repeatable; default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--keep", help="write the synthetic experiment here and keep it")
    ap.add_argument("--reuse", action="store_true", help="with --keep: measure the experiment already there")
    args = ap.parse_args(argv)
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="polar-bench-compare-"))
    root = tmp / "experiment"
    try:
        t0 = time.perf_counter()
        if args.reuse and (tmp / "synth.json").exists():
            info = json.loads((tmp / "synth.json").read_text())
        else:
            if root.exists():
                shutil.rmtree(root)
            info = synthesize(args.src, root, args.episodes, only=tuple(args.harness))
            (tmp / "synth.json").write_text(json.dumps(info))
        synth_s = time.perf_counter() - t0
        _floor(root)  # warm the page cache
        floor, floor_cols, report, page = [], [], [], []
        for _ in range(args.repeat):
            floor.append(_floor(root))
            floor_cols.append(_floor(root, REPORT_COLUMNS))
            report.append(_report(root, None))
            page.append(_report(root, tmp / "report.html"))
        size = sum(p.stat().st_size for p in root.glob("*/shards/shard-*.parquet"))
        res = {"episodes": sum(v["episodes"] for v in info.values()), "harnesses": info,
               "rows": sum(v["rows"] for v in info.values()), "tokens": sum(v["tokens"] for v in info.values()),
               "shard_mib": round(size / 2**20, 1), "synthesize_s": round(synth_s, 2),
               "floor_s": round(statistics.median(floor), 3),
               "floor_report_columns_s": round(statistics.median(floor_cols), 3), "report_s": round(statistics.median(report), 3),
               "report_html_s": round(statistics.median(page), 3),
               "html_mib": round((tmp / "report.html").stat().st_size / 2**20, 2)}
        res["report_over_floor"] = round(res["report_s"] / res["floor_s"], 2)
        res["report_html_over_floor"] = round(res["report_html_s"] / res["floor_s"], 2)
        res["report_over_column_floor"] = round(res["report_s"] / res["floor_report_columns_s"], 2)
        if args.json:
            print(json.dumps(res))
        else:
            for k, v in res.items():
                print(f"{k:24} {v}")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
