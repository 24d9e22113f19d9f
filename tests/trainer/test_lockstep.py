"""ShardRollout's lockstep filling with several ranks, one rank real (a ShardSource on real shards) and
the other ranks' answers to the per-round exchange scripted (the 2-process run is test_ranks.py; this
covers the rounds the real run does not reach: waiting for a slower rank, another rank failing)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.trainer.shardkit import row, synthetic_seq, write_shard
from trainer.shard_rollout import ShardRollout
from trainer.shard_source import NoShardsError, ShardSource

P = [151644, 872, 198, 151645, 198, 151644, 77091, 198]


class Exchange:
    """accelerator.gather for rank 0 of 2: this rank's flags, then rank 1's scripted ones per round."""

    def __init__(self, other_rounds: list[list[int]]):
        self.other, self.rounds, self.device = list(other_rounds), 0, torch.device("cpu")

    def gather(self, mine: torch.Tensor) -> torch.Tensor:
        self.rounds += 1
        other = self.other.pop(0) if len(self.other) > 1 else self.other[0]
        return torch.cat([mine, torch.tensor([other])])


def rollout(tmp_path, other_rounds, timeout=None):
    rows = [row(synthetic_seq(P, [300 + g * 10 + e, 151645]), f"g{g}-e{e}", f"g{g}", float(e)) for g in range(4)
            for e in range(2)]
    write_shard(tmp_path, 1, rows)  # groups g0..g3; rank 0 owns (1 + k) % 2 == 0: g1, g3
    src = ShardSource(str(tmp_path), rank=0, world_size=2, poll_interval=0.01)
    r = ShardRollout(src, 2, wait_timeout=timeout)
    trainer = SimpleNamespace(accelerator=Exchange(other_rounds))
    return r, trainer


def test_a_done_rank_waits_for_the_others_and_keeps_its_rows(tmp_path):
    r, tr = rollout(tmp_path, [[0, 0, 0], [0, 0, 0], [1, 0, 0]])
    cols = r([None] * 4, tr)
    assert tr.accelerator.rounds == 3
    assert cols["group_id"] == ["g1", "g1", "g3", "g3"]


def test_any_rank_timing_out_stops_every_rank(tmp_path):
    r, tr = rollout(tmp_path, [[1, 0, 0], [0, 1, 0]], timeout=30)
    with pytest.raises(NoShardsError, match=r"rank\(s\) \[1\] of 2"):
        r([None] * 4, tr)
        r([None] * 4, tr)


def test_another_rank_failing_stops_this_one(tmp_path):
    r, tr = rollout(tmp_path, [[0, 0, 1]])
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] failed"):
        r([None] * 4, tr)


def test_a_stream_whose_every_group_is_excluded_says_why_and_how_to_fix_it(tmp_path):
    """Stock server, proxy without the option and no discovery possible: every row's truncation is
    null. The groups are read, excluded and skipped; the wait's error then names the reason, the
    row's own sampling_source, and the fix (polar_generation_config), not just "no complete group"."""
    why = ("unknown: the server serves 'Qwen/Qwen3-8B' (vllm GET /v1/models root), which is not a directory on "
           "the proxy's machine: set polar_generation_config to the served model's directory")
    rows = [row(synthetic_seq(P, [300 + g * 10 + e, 151645]), f"g{g}-e{e}", f"g{g}", float(e), temperature=None,
                top_p=None, top_k=None, min_p=None, logprobs_mode="processed", sampling_source=why)
            for g in range(2) for e in range(2)]
    write_shard(tmp_path, 1, rows)
    r = ShardRollout(ShardSource(str(tmp_path), poll_interval=0.01), 2, wait_timeout=0.05, temperature=0.6,
                     served_default_temperature=0.6, is_correction=True)
    with pytest.raises(NoShardsError) as e:
        r([None] * 4, None)
    msg = str(e.value)
    assert msg.startswith("no complete group in") and "unknown_truncation: 4 rows" in msg, msg
    assert why in msg and "--set polar_generation_config=" in msg and "'too_few_episodes': 2" in msg
