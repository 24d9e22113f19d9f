"""Episodes in real TRL batches (CPU, tiny Qwen3): advantages per episode, no episode dropped for its
segments (multi-block groups, deferral to the next batch with an exact cursor), termination reaching
mask_truncated_completions, rows past the model's length excluded and counted."""
from __future__ import annotations

import json
import math

import pytest

from tests.trainer.shardkit import row, synthetic_seq, write_shard
from tests.trainer.test_grpo_trainer import Recording, config, trainer, unpad
from trainer.advantages import EPS
from trainer.shard_rollout import GroupTooLarge
from trainer.shard_source import CURSOR_FILE

P = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # <|im_start|>user\nHello<|im_end|>\n...assistant\n
EOS = 151645


def seq(k: int, n: int = 3, end: int | None = EOS):
    c = [100 + k + j for j in range(n)]
    if end is not None:
        c[-1] = end
    return synthetic_seq(P, c)


def adv_of(out):
    a = out["advantages"]
    return a if a.dim() == 1 else a[:, 0]


def test_lone_success_with_segments_is_kept_and_counted_once(tmp_path, tiny_dir):
    # The case: G=4, the group's only success has 3 segments; before, it did not fit in 4 rows
    # and was dropped, leaving 3 failures with advantage 0.
    rows = [row(seq(s), "A-win", "A", 1.0, segment=s) for s in range(3)]
    rows += [row(seq(10 + e), f"A-l{e}", "A", 0.0) for e in range(3)]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, per_device_train_batch_size=8, num_generations=4, learning_rate=0.0,
                                 vllm_importance_sampling_correction=False))
    t.train()
    out = t.gens[0]
    assert [unpad(out, i)["completion"] for i in range(6)] == [r["input_ids"][len(P):] for r in rows]
    adv = adv_of(out)
    std = math.sqrt(((3 / 4) ** 2 + 3 * (1 / 4) ** 2) / 3)  # over the 4 EPISODES (Bessel), not the 6 rows
    assert adv[:3].tolist() == pytest.approx([(3 / 4) / (std + EPS)] * 3, rel=1e-5)
    assert adv[3:6].tolist() == pytest.approx([(-1 / 4) / (std + EPS)] * 3, rel=1e-5)
    assert adv[6:].tolist() == [0.0, 0.0]  # padding rows
    st = t.shard_rollout.stats
    assert st.groups_multi_block == 1 and st.rows_padded == 2 and not st.skipped
    logs = [h for h in t.state.log_history if "polar/groups_multi_block_total" in h]
    assert logs and logs[0]["polar/groups_multi_block_total"] == 1


def test_group_that_does_not_fit_goes_to_the_next_batch(tmp_path, tiny_dir):
    a = [row(seq(e), f"A-e{e}", "A", float(e == 0)) for e in range(4)]  # 4 rows: one block
    b = [row(seq(20 + s), "B-e0", "B", 1.0, segment=s) for s in range(3)]
    b += [row(seq(30 + e), f"B-e{e}", "B", 0.0) for e in range(1, 4)]  # 6 rows: two blocks
    c = [row(seq(40 + e), f"C-e{e}", "C", float(e == 1)) for e in range(4)]
    write_shard(tmp_path / "shards", 1, a + b + c)
    t = trainer(tiny_dir, config(tmp_path, per_device_train_batch_size=8, num_generations=4, learning_rate=0.0,
                                 vllm_importance_sampling_correction=False, max_steps=2, save_strategy="steps",
                                 save_steps=1))
    t.train()
    first, second = t.gens
    assert [unpad(first, i)["completion"] for i in range(4)] == [r["input_ids"][len(P):] for r in a]
    assert all(len(unpad(first, i)["completion"]) == 1 for i in range(4, 8))  # padding: B waits
    assert adv_of(first)[4:].abs().sum() == 0 and (first["tool_mask"][4:] * first["completion_mask"][4:]).sum() == 0
    assert [unpad(second, i)["completion"] for i in range(6)] == [r["input_ids"][len(P):] for r in b]
    st = t.shard_rollout.stats
    assert st.groups_deferred == 1 and st.groups == 2
    # The checkpoint after batch 1 counts only A: B was put back, so a resume trains B next.
    ck1 = json.loads((tmp_path / "out" / "checkpoint-1" / CURSOR_FILE).read_text())
    assert ck1 == {"consumed": [], "current": "shard-000001.parquet", "group_offset": 1}


def test_group_larger_than_a_batch_stops_with_the_fix(tmp_path, tiny_dir):
    rows = [row(seq(s), "A-e0", "A", 1.0, segment=s) for s in range(4)] + [row(seq(9), "A-e1", "A", 0.0)]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, per_device_train_batch_size=4, num_generations=2, learning_rate=0.0,
                                 vllm_importance_sampling_correction=False))
    with pytest.raises(GroupTooLarge, match="per_device_train_batch_size"):
        t.train()


def test_termination_reaches_mask_truncated_completions(tmp_path, tiny_dir):
    rows = [row(seq(0), "A-e0", "A", 1.0, termination="stop"),
            row(seq(1), "A-e1", "A", 0.0, termination="length"),  # ends in EOS, still truncated
            row(seq(2, end=None), "A-e2", "A", 0.0, termination="stop"),  # no EOS at the end, not truncated
            row(seq(3, end=None), "A-e3", "A", 1.0)]  # no termination (older shard): TRL's last-token rule
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, per_device_train_batch_size=4, num_generations=4, learning_rate=0.0,
                                 vllm_importance_sampling_correction=False, mask_truncated_completions=True))
    t.train()
    out = t.gens[0]
    trained = (out["tool_mask"] * out["completion_mask"]).sum(1).tolist()
    assert trained == [3, 0, 3, 0]
    assert t.shard_rollout.stats.rows_masked_truncated == 2
    # Off: nothing masked, whatever the last token.
    t2 = trainer(tiny_dir, config(tmp_path / "off", shards=str(tmp_path / "shards"), per_device_train_batch_size=4,
                                  num_generations=4, learning_rate=0.0, vllm_importance_sampling_correction=False))
    t2.train()
    assert (t2.gens[0]["tool_mask"] * t2.gens[0]["completion_mask"]).sum(1).tolist() == [3, 3, 3, 3]


def test_rows_past_the_length_limit_are_excluded_and_counted(tmp_path, tiny_dir):
    rows = [row(seq(0), "A-e0", "A", 1.0), row(seq(1, n=30), "A-e1", "A", 0.0, segment=0),
            row(seq(2), "A-e1", "A", 0.0, segment=1), row(seq(3), "A-e2", "A", 0.0)]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, per_device_train_batch_size=4, num_generations=4, learning_rate=0.0,
                                 vllm_importance_sampling_correction=False, shard_max_length=20), cls=Recording)
    t.train()
    out = t.gens[0]
    # Episode A-e1 (both its rows) is out; A-e0 and A-e2 remain, with 2 padding rows.
    assert [unpad(out, i)["completion"] for i in range(2)] == [rows[0]["input_ids"][len(P):],
                                                                 rows[3]["input_ids"][len(P):]]
    assert t.shard_rollout.stats.rows_excluded == {"too_long": 2}
    logs = [h for h in t.state.log_history if "polar/rows_excluded_too_long_total" in h]
    assert logs[0]["polar/rows_excluded_too_long_total"] == 2
    # Default limit: the model's max_position_embeddings.
    assert t.shard_rollout.max_length == 20
    t2 = trainer(tiny_dir, config(tmp_path / "d", shards=str(tmp_path / "shards")))
    assert t2.shard_rollout.max_length == t2.model.config.max_position_embeddings


def test_per_row_mean_loss_weighs_an_episode_once(tmp_path, tiny_dir):
    # loss_type grpo averages each row's token mean over rows: the 3 segments of A-win (3, 3 and 6 trainable
    # tokens) get 1/4, 1/4, 1/2 of the episode's advantage, so together they weigh one row of 12 tokens.
    rows = [row(seq(s, n=6 if s == 2 else 3), "A-win", "A", 1.0, segment=s) for s in range(3)]
    rows += [row(seq(10 + e), f"A-l{e}", "A", 0.0) for e in range(3)]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, per_device_train_batch_size=8, num_generations=4, learning_rate=0.0,
                                 vllm_importance_sampling_correction=False, loss_type="grpo"))
    t.train()
    adv = adv_of(t.gens[0])
    std = math.sqrt(((3 / 4) ** 2 + 3 * (1 / 4) ** 2) / 3)
    a_win, a_lose = (3 / 4) / (std + EPS), (-1 / 4) / (std + EPS)
    assert adv[:6].tolist() == pytest.approx([a_win / 4, a_win / 4, a_win / 2] + [a_lose] * 3, rel=1e-5)
