"""Trainer-side shard streaming cost: landing -> training latency, and the share of step time spent loading.

    .venv/bin/python bench/bench_trainer.py [--shards 10] [--interval 1.0] [--prompt 64] [--completion 32]

Three measurements:
- stream: PolarGRPOTrainer trains the tiny Qwen3 on CPU (real TRL steps) while a writer thread lands
  one shard (one generation batch of groups, temp name + rename, as polar-recon does) --gap seconds
  after the trainer took the previous one, so the trainer is waiting when it lands. Latency = rename
  -> the group handed to the training step (directory polling + parquet read + grouping).
- backlog: all shards exist before training: the share of step time spent loading, with no waiting.
  Load = listing + parquet read + grouping (ShardSource.stats.load_seconds); share = load / (training
  wall time - time spent waiting for shards to land).
- loader: throughput of ShardSource alone on large shards (--big-rows x --big-tokens per shard), to
  compare with real GPU step times (the tiny CPU model's steps are not representative).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("POLAR_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))  # the checkout's, as make


def make_rows(shard_no: int, groups: int, g: int, prompt: int, completion: int, rng: random.Random) -> list[dict]:
    from polar_recon.testing import row, synthetic_seq

    rows = []
    for k in range(groups):
        gid = f"s{shard_no}g{k}"
        for e in range(g):
            p = [151644, 872, 198] + [rng.randrange(1000, 100000) for _ in range(prompt - 6)] + [151645, 151644, 77091]
            c = [rng.randrange(1000, 100000) for _ in range(completion - 1)] + [151645]
            rows.append(row(synthetic_seq(p, c, logprob=-11.9), f"{gid}-e{e}", gid, float(rng.random() < 0.5),
                            group_size=g))
    return rows


class TimedSource:
    """Wraps ShardSource.next_group to note when each group is handed to the trainer."""

    def __init__(self, src):
        self.handed: dict[str, float] = {}
        self.blocked = threading.Event()  # set while the trainer asks for a group
        self._orig = src.next_group
        src.next_group = self.next_group

    def next_group(self, timeout=None):
        self.blocked.set()
        try:
            grp = self._orig(timeout)
        finally:
            self.blocked.clear()
        self.handed[grp.group_id] = time.time()
        return grp


def run(args, mode: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness_recipes.cache import tiny_model
    from polar_recon.testing import write_shard
    from trainer.grpo_config import PolarGRPOConfig
    from trainer.grpo_trainer import PolarGRPOTrainer
    from trainer.shard_source import ShardSource

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    groups_per_shard = args.batch // args.g
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-trainer-{mode}-"))
    shards = tmp / "shards"
    landed: dict[str, float] = {}

    def land(i: int):
        rows = make_rows(i, groups_per_shard, args.g, args.prompt, args.completion, rng)
        write_shard(shards, i, rows)
        t = time.time()
        for r in rows:
            landed.setdefault(r["group_id"], t)

    if mode == "backlog":
        for i in range(args.shards):
            land(i)
    cfg = PolarGRPOConfig(output_dir=str(tmp / "out"), shards=str(shards), max_steps=args.shards,
                          per_device_train_batch_size=args.batch, num_generations=args.g, learning_rate=1e-5,
                          logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                          gradient_checkpointing=False, shard_poll_interval=args.poll, shard_wait_timeout=120,
                          disable_tqdm=True, temperature=1.0)
    d = tiny_model()
    src = ShardSource(str(shards), poll_interval=args.poll)
    timed = TimedSource(src)
    trainer = PolarGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32), args=cfg,
                               processing_class=AutoTokenizer.from_pretrained(str(d)), source=src)
    writer = None
    if mode == "stream":
        def write_all():
            for i in range(args.shards):
                # Land the next shard only once the trainer has taken the previous one and asks for more.
                while i and not (timed.blocked.is_set() and any(g.startswith(f"s{i - 1}g") for g in list(timed.handed))):
                    time.sleep(0.005)
                time.sleep(args.gap)
                land(i)
        writer = threading.Thread(target=write_all, daemon=True)
        writer.start()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    if writer:
        writer.join()
    shutil.rmtree(tmp, ignore_errors=True)
    lat = sorted(timed.handed[g] - landed[g] for g in timed.handed)
    # Per shard: the first group of a shard is what waits for the landing.
    first = sorted(timed.handed[g] - landed[g] for g in timed.handed if g.endswith("g0"))
    busy = wall - src.stats.wait_seconds
    steps = [h["step_time"] for h in trainer.state.log_history if "step_time" in h]
    return {
        "mode": mode, "steps": args.shards, "wall_s": wall, "wait_s": src.stats.wait_seconds,
        "load_s": src.stats.load_seconds, "load_share": src.stats.load_seconds / busy,
        "step_time_mean_s": statistics.mean(steps) if steps else float("nan"),
        "landing_to_step_p50_s": statistics.median(first), "landing_to_step_max_s": max(first),
        "all_groups_p50_s": statistics.median(lat),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--gap", type=float, default=0.3, help="stream: seconds between a take and the next landing")
    ap.add_argument("--batch", type=int, default=4, help="rows per step (per_device_train_batch_size)")
    ap.add_argument("--g", type=int, default=2, help="num_generations")
    ap.add_argument("--prompt", type=int, default=48)
    ap.add_argument("--completion", type=int, default=16)
    ap.add_argument("--big-rows", type=int, default=64)
    ap.add_argument("--big-tokens", type=int, default=4096)
    ap.add_argument("--big-shards", type=int, default=4)
    ap.add_argument("--poll", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default="stream,backlog,loader")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        if mode == "loader":
            loader(args)
            continue
        r = run(args, mode)
        print(f"[{mode}] {r['steps']} steps, {args.batch} rows x {args.prompt}+{args.completion} tokens, "
              f"poll {args.poll}s: wall {r['wall_s']:.2f}s, waiting {r['wait_s']:.2f}s, loading {r['load_s']*1e3:.1f}ms "
              f"= {100 * r['load_share']:.2f}% of busy time; mean step {r['step_time_mean_s']:.3f}s; "
              f"shard landing -> step: p50 {r['landing_to_step_p50_s']*1e3:.0f}ms, max {r['landing_to_step_max_s']*1e3:.0f}ms "
              f"(all groups p50 {r['all_groups_p50_s']*1e3:.0f}ms)")


def loader(args) -> None:
    from polar_recon.testing import write_shard
    from trainer.shard_source import ShardSource

    rng = random.Random(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-trainer-loader-"))
    g = args.g
    for i in range(args.big_shards):
        rows = make_rows(i, args.big_rows // g, g, args.big_tokens // 2, args.big_tokens // 2, rng)
        write_shard(tmp, i, rows)
    src = ShardSource(str(tmp))
    t0 = time.perf_counter()
    n = 0
    while (grp := src.try_next()) is not None:
        n += sum(len(r["input_ids"]) for r in grp.rows)
    dt = time.perf_counter() - t0
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"[loader] {args.big_shards} shards x {args.big_rows} rows x {args.big_tokens} tokens: {n / 1e6:.2f}M tokens "
          f"in {dt:.2f}s = {n / dt / 1e6:.2f}M tokens/s ({src.stats.load_seconds:.2f}s in ShardSource loading)")


if __name__ == "__main__":
    main()
