"""Two training processes under ``accelerate launch`` (CPU, gloo, tiny Qwen3) on one shard directory:
each rank trains distinct groups, together every group; per-rank cursors in the checkpoints; when one
rank's partition runs dry, every rank stops (NoShardsError) instead of one hanging in a collective."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.trainer.shardkit import row, synthetic_seq, write_shard
from trainer.shard_source import ShardCursor, group_owner

REPO = Path(__file__).resolve().parents[2]
P = [151644, 872, 198, 151645, 198, 151644, 77091, 198]
PLAIN = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0, "logprobs_mode": "processed"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group(name: str, k: int) -> list[dict]:
    return [row(synthetic_seq(P, [400 + 10 * k + e, 151645]), f"{name}-e{e}", name, float(e), group_size=2, **PLAIN)
            for e in range(2)]


def test_two_ranks_partition_the_groups(tmp_path, tiny_dir):
    # accelerate's --cpu flag runs ONE process (its simple launcher); --multi_gpu on a machine without
    # GPUs starts torchrun with 2 processes, and accelerate picks gloo on CPU (use_cpu=True in the config).
    shards, out = tmp_path / "shards", tmp_path / "out"
    names = {}
    for seq in range(1, 5):  # 4 shards x 2 groups: 4 groups per rank
        names[seq] = [f"s{seq}g{i}" for i in range(2)]
        write_shard(shards, seq, group(names[seq][0], 2 * seq) + group(names[seq][1], 2 * seq + 1))
    write_shard(shards, 5, group("s5g0", 99))  # a 9th group: rank (5 + 0) % 2 = 1 has one more than rank 0
    names[5] = ["s5g0"]
    owner = {n: group_owner(f"shard-{seq:06d}.parquet", i, 2) for seq, ns in names.items() for i, n in enumerate(ns)}
    assert sorted(owner.values()).count(1) == 5
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "2", "--num_machines", "1",
           "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
           str(REPO / "tests" / "trainer" / "dist_ranks.py"), str(shards), str(out), str(tiny_dir), "5", "4"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=170)
    took = time.monotonic() - t0
    reports = {}
    for r in (0, 1):
        path = out / f"rank{r}.json"
        assert path.is_file(), f"rank {r} wrote no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        reports[r] = json.loads(path.read_text())
    r0, r1 = reports[0], reports[1]
    assert r0["world_size"] == r1["world_size"] == 2
    # Steps 1-4: every rank trained its own groups; disjoint, and together every group of shards 1-4.
    t0s, t1s = [g for b in r0["trained"] for g in b], [g for b in r1["trained"] for g in b]
    assert len(t0s) == len(t1s) == 4 and not set(t0s) & set(t1s)
    assert set(t0s) | set(t1s) == {n for seq in range(1, 5) for n in names[seq]}
    assert all(owner[g] == 0 for g in t0s) and all(owner[g] == 1 for g in t1s)
    # Step 5: rank 1 took the 9th group, rank 0 had none: both stopped, together, naming rank 0.
    assert set(r0["taken"]) | set(r1["taken"]) == set(owner) and not set(r0["taken"]) & set(r1["taken"])
    for r in (r0, r1):
        assert r["steps"] == 4
        assert r["error"] and r["error"].startswith("NoShardsError") and "rank(s) [0] of 2" in r["error"], r["error"]
    assert took < 170 and proc.returncode == 0, proc.stderr[-3000:]  # the script reports the error itself
    # Every rank saved its own cursor into the checkpoints; each resumes its own partition.
    ck = out / "checkpoint-4"
    c0, c1 = ShardCursor.load(ck, 0, 2), ShardCursor.load(ck, 1, 2)
    # rank 0 last took group 0 of shard 4 (group 1 is rank 1's, not yet stepped over); rank 1 took group 1.
    assert (c0.consumed, c0.current, c0.group_offset) == ([f"shard-{s:06d}.parquet" for s in range(1, 4)],
                                                          "shard-000004.parquet", 1)
    assert (c1.consumed, c1.current) == ([f"shard-{s:06d}.parquet" for s in range(1, 5)], None)


def test_two_ranks_share_the_version_history_under_a_staleness_bound(tmp_path, tiny_dir):
    """Weight sync to a real polar-serve with max_policy_lag 1: rank 0 syncs, and every rank's source learns
    the same history (weight_sync.py broadcasts it), so both ranks drop the same stale group and train
    the rest. (Before: only rank 0 learned versions; rank 1 could bound no string version.)"""
    from tests.support import servers

    shards, out = tmp_path / "shards", tmp_path / "out"
    versions = {1: "default", 2: "default", 3: "default", 4: "1"}  # shard 3 is 2 syncs old at step 3
    for seq, v in versions.items():
        rows = [dict(r, weight_version=v) for k in range(2) for r in group(f"s{seq}g{k}", 2 * seq + k)]
        write_shard(shards, seq, rows)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(REPO)}
    with servers.polar_serve(tiny_dir, "vllm") as srv:  # weight_version "default", then the reload counter
        over = {"sync_server": srv.base_url, "sync_steps": 1, "sync_keep": 1, "max_policy_lag": 1,
                "save_strategy": "no"}
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "2", "--num_machines",
               "1", "--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(free_port()), str(REPO / "tests" / "trainer" / "dist_ranks.py"), str(shards), str(out),
               str(tiny_dir), "3", "20", json.dumps(over)]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    reports = {}
    for r in (0, 1):
        path = out / f"rank{r}.json"
        assert path.is_file(), f"rank {r} wrote no report (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
        reports[r] = json.loads(path.read_text())
    for r in reports.values():
        assert r["error"] is None and r["steps"] == 3, (r, proc.stderr[-3000:])
        assert r["history"] == ["default", "1", "2", "3"], r
        assert r["dropped"] == {"policy_lag": 1}, r  # its shard-3 group, 2 syncs behind at step 3
        assert [len(b) for b in r["trained"]] == [1, 1, 1]
        assert [b[0][:2] for b in r["trained"]] == ["s1", "s2", "s4"]
