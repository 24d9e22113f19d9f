"""The importance ratio under truncated sampling (docs/training.md): the trainer's old-policy log-probs use the
transform each row's logprobs reflect, so on-policy rows sampled with Qwen3's defaults (T=0.6, top_k=20,
top_p=0.95) give ratio 1 where the full softmax would mask every row; raw/unknown logprob modes are
counted exclusions that stop the run with the fix past max_excluded_share; rows the trainer cannot
reproduce are excluded, counted and logged."""
from __future__ import annotations

import logging

import pytest
import torch

from tests.trainer.shardkit import Sampler, row, write_shard
from tests.trainer.test_grpo_trainer import config, real_groups, trainer
from trainer.is_correction import is_ratio
from trainer.row_exclusions import ExcludedShareError


@pytest.fixture(scope="module")
def qwen3_sampler(tiny_dir):
    return Sampler(tiny_dir, seed=1, temperature=0.6, top_k=20, top_p=0.95)


def test_truncated_on_policy_rows_give_ratio_one(tmp_path, tiny_dir, qwen3_sampler):
    rows = real_groups(qwen3_sampler, 2, "q", turns=(1, 2))
    assert all(r["top_k"] == 20 and r["logprobs_mode"] == "processed" for r in rows)
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6))  # TRL's default: sequence_mask
    t.train()
    out, st = t.gens[0], t.gens[0]["is_stats"]
    assert st["logp_diff_mean"] < 1e-3 and st["logp_diff_max"] < 1e-3, st
    assert st["clipped_frac"] == 0.0 and st["min"] > 0.99 and st["max"] < 1.01, st
    # The full softmax (TRL's logps at the same temperature) against the same behaviour logprobs:
    # each token's ratio is its kept mass, and sequence_mask drops rows.
    full = t._policy_logps(out)
    mask = out["completion_mask"] * out["tool_mask"]
    _, fst = is_ratio(full, out["sampling_per_token_logps"], mask, "sequence_mask", None, 3.0)
    assert fst["logp_diff_mean"] > 0.05 and fst["raw_mean"] < 0.9, fst
    logs = [h for h in t.state.log_history if "polar/is_tokens_outside_kept_set" in h]
    assert logs and logs[0]["polar/is_tokens_outside_kept_set"] == 0


def test_scaled_logprobs_use_temperature_only(tmp_path, tiny_dir):
    s = Sampler(tiny_dir, seed=2, temperature=0.6, top_k=20, top_p=0.95, logprobs="scaled")  # SGLang's default
    write_shard(tmp_path / "shards", 1, real_groups(s, 2, "s", turns=(1,)))
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6))
    t.train()
    st = t.gens[0]["is_stats"]
    assert st["logp_diff_max"] < 1e-3 and st["clipped_frac"] == 0.0, st


@pytest.mark.parametrize("mode", ["raw", None])
def test_raw_and_unknown_logprob_modes_are_excluded_then_stop_with_the_fix(tmp_path, tiny_dir, qwen3_sampler, mode):
    """Every row raw / unknown: each is a counted exclusion (no single row aborts); once the excluded share
    passes max_excluded_share the run stops naming the fix (tests/trainer/test_numerics_mismatch.py has
    the mixed case)."""
    rows = [dict(r, logprobs_mode=mode) for r in real_groups(qwen3_sampler, 1, "r", turns=(1,))]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, max_steps=1, per_device_train_batch_size=2,
                                 temperature=0.6, excluded_share_window=10))
    with pytest.raises(ExcludedShareError, match=r"--logprobs-mode processed_logprobs"):
        t.train()
    assert sum(t.shard_rollout.stats.rows_excluded.values()) == 2
    # Without the correction the recorded logprobs are not used: the same rows train.
    t = trainer(tiny_dir, config(tmp_path / "off", shards=str(tmp_path / "shards"), learning_rate=0.0, max_steps=1,
                                 per_device_train_batch_size=2, vllm_importance_sampling_correction=False,
                                 temperature=0.6))
    t.train()


def test_raw_rows_of_identity_sampling_train_with_ratio_one(tmp_path, tiny_dir, sampler):
    """T=1, no truncation, nothing unsupported (the demo's forced-reply vLLM): raw logprobs are the
    sampled distribution's, so they are accepted, and the ratio is 1."""
    rows = [dict(r, logprobs_mode="raw") for r in real_groups(sampler, 2, "i", turns=(1,))]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0))
    t.train()
    st = t.gens[0]["is_stats"]
    assert st["logp_diff_max"] < 1e-3 and st["clipped_frac"] == 0.0, st


def test_unreproducible_rows_are_excluded_counted_and_logged(tmp_path, tiny_dir, sampler, caplog):
    a = real_groups(sampler, 1, "a", turns=(1,)) + [
        row(r, "a0-e2", "a0", 0.5, group_size=3, **sampler.columns) for r in [sampler.episode("extra", n_tokens=5)]]
    a[0] = dict(a[0], sampling_unsupported="presence_penalty=0.5")  # episode a0-e0: excluded
    b = real_groups(sampler, 1, "b", turns=(1,))
    b[1] = dict(b[1], top_k=None)  # unknown truncation: excluded, its group then has one episode: skipped
    c = real_groups(sampler, 1, "c", turns=(1,))
    write_shard(tmp_path / "shards", 1, a + b + c)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, max_steps=1))
    with caplog.at_level(logging.WARNING, logger="trainer.shard_rollout"):
        t.train()
    st = t.shard_rollout.stats
    assert sum(st.rows_excluded.values()) == 2, st.rows_excluded
    assert st.rows_excluded == {"sampling_unsupported": 1, "unknown_truncation": 1}
    assert st.skipped == {"too_few_episodes": 1}
    msgs = caplog.text
    assert "excluding episode a0-e0" in msgs and "presence_penalty=0.5" in msgs and "excluding episode b0-e1" in msgs
    out = t.gens[0]
    trained = {tuple(out["completion_ids"][i][out["completion_mask"][i].bool()].tolist()) for i in range(4)}
    p = a[1]["prompt_len"]
    assert tuple(a[1]["input_ids"][p:]) in trained and tuple(a[0]["input_ids"][a[0]["prompt_len"]:]) not in trained
    logs = [h for h in t.state.log_history if "polar/rows_excluded_sampling_total" in h]
    assert logs[0]["polar/rows_excluded_sampling_total"] == 2


def test_hook_matches_trl_logps_without_truncation(tmp_path, tiny_dir, sampler):
    """The hook's own forward (used when rows truncate) equals TRL's logps when nothing truncates."""
    from trainer.behaviour_logprobs import Transform

    write_shard(tmp_path / "shards", 1, real_groups(sampler, 2, "h"))
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0))
    t.train()
    out = t.gens[0]
    trl = t._policy_logps(out)
    mask = (out["completion_mask"] * out["tool_mask"]).bool()
    # Force the hook's own path with a transform that truncates nothing but is marked as truncating.
    wide = Transform(1.0, top_k=151936 * 2)
    assert wide.truncates
    ours = t._old_policy_logps(out, [wide] * out["completion_ids"].size(0))
    assert torch.allclose(ours[mask], trl[mask], atol=1e-5)
    # server_logits_dtype reaches the cuts: the hook passes it to sampled_token_logprobs as cut_dtype
    import trainer.grpo_trainer as gt

    seen = []

    def spy(*a, **kw):
        seen.append(kw.get("cut_dtype"))
        return real(*a, **kw)

    real, gt.sampled_token_logprobs = gt.sampled_token_logprobs, spy
    try:
        cut = Transform(0.6, 20, 0.95, 0.05)
        t.args.server_logits_dtype = "bfloat16"
        t._old_policy_logps(out, [cut] * out["completion_ids"].size(0))
        t.args.server_logits_dtype = None
        t._old_policy_logps(out, [cut] * out["completion_ids"].size(0))
    finally:
        gt.sampled_token_logprobs = real
    rows = int(mask.any(-1).sum())
    assert seen == [torch.bfloat16] * rows + [None] * rows
