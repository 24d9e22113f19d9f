"""A training signal that holds when the trainer's numerics differ from the server's.
No single row aborts a run (raw / unknown logprobs, a temperature mismatch, greedy rows: counted
exclusions); the run stops only past max_excluded_share, naming the cause and the fix; the sampled
token always counts as kept; non-finite logprobs are masked token by token; realigned rows are gated
and get no correction; null versions are counted; every metric reaches TRL's log history."""
from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.shardkit import Sampler, row, write_shard
from tests.trainer.test_grpo_trainer import config, trainer
from trainer.behaviour_logprobs import BOUNDARY_TOL, Transform, mask_logits_, sampled_token_logprobs, token_logprobs
from trainer.is_correction import is_ratio_masks
from trainer.row_exclusions import ExcludedShareError, ExclusionLedger, resolve_row


def group(sampler, name: str, n: int = 3, first: dict | None = None, **row_kw) -> list[dict]:
    """n one-turn episodes of one task; the first episode's row gets ``first`` (its columns overridden)."""
    rows = []
    for e in range(n):
        seq = sampler.episode(f"{name}: say something", n_tokens=5)
        r = row(seq, f"{name}-e{e}", name, reward=float(e % 2), group_size=n, **sampler.columns, **row_kw)
        rows.append(dict(r, **(first or {})) if e == 0 else r)
    return rows


def logged(t, key: str) -> list[float]:
    return [h[key] for h in t.state.log_history if key in h]


# -- units -------------------------------------------------------------------------------------------

def test_a_sampled_token_at_the_boundary_is_kept_and_one_far_outside_is_not():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 200, generator=g) * 2
    t = Transform(0.6, 20, 0.95)
    z = logits / 0.6
    kept = torch.isfinite(mask_logits_(z.clone(), t))
    weakest = torch.where(kept, z, math.inf).amin(-1)
    inside = torch.stack([row.nonzero()[0, 0] for row in kept])  # a kept token per position
    # a masked token within BOUNDARY_TOL of the weakest kept one (numerics), and the least likely one
    near_ok = [(~kept[i]) & (z[i] >= weakest[i] - BOUNDARY_TOL) for i in range(64)]
    rows = [i for i in range(64) if near_ok[i].any()]
    assert len(rows) >= 16, "the fixture must have boundary tokens to test"
    near = torch.stack([near_ok[i].nonzero()[0, 0] for i in rows])
    far = z.argmin(-1)
    assert bool((z.gather(-1, far[:, None]).squeeze(-1) < weakest - BOUNDARY_TOL).all())
    lp, added = sampled_token_logprobs(logits[rows], near, t)
    assert bool(added.all()) and torch.isfinite(lp).all()
    # renormalised over the trainer's kept set plus the sampled token
    want = torch.stack([torch.where(kept[i] | (torch.arange(200) == tok), z[i], -math.inf).log_softmax(-1)[tok]
                        for i, tok in zip(rows, near.tolist())])
    assert torch.allclose(lp, want, atol=1e-5)
    # far outside the set: not numerics but a row whose tokens do not fit its logprobs: -inf (masked, counted)
    lp_far, added_far = sampled_token_logprobs(logits, far, t)
    assert not bool(added_far.any()) and torch.isneginf(lp_far).all()
    lp_in, added_in = sampled_token_logprobs(logits, inside, t)
    assert not bool(added_in.any()) and torch.isfinite(lp_in).all()
    old = token_logprobs(logits[rows], near, t, keep_sampled=False)  # the old rule
    assert torch.isneginf(old).all()
    # tokens inside the set: the same value under both rules (the exact vLLM distribution)
    assert torch.equal(token_logprobs(logits, inside, t), token_logprobs(logits, inside, t, keep_sampled=False))


def test_is_stats_are_finite_and_count_what_they_mask():
    old = torch.tensor([[-1.0, -math.inf, -1.0, 0.0], [-1.0, -1.0, float("nan"), 0.0], [-1.0, -1.0, -1.0, 0.0]])
    beh = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [-1.0, -1.0, -1.0, 0.0], [-5.0, -5.0, -5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    for mode in ("token_mask", "sequence_mask", "token_truncate", "sequence_truncate"):
        ratio, st, bad = is_ratio_masks(old, beh, mask, mode, None, 3.0)
        assert all(math.isfinite(v) for v in st.values()), (mode, st)
        assert st["nonfinite_tokens"] == 2 and bad.tolist() == [[False, True, False, False],
                                                                [False, False, True, False], [False] * 4]
        assert st["logp_diff_max"] == pytest.approx(4.0)  # over finite tokens only (not 1.6e37)
        if mode == "sequence_mask":  # row 2: exp(12) > 3, masked; rows 0 and 1 keep ratio 1 (the bad token dropped)
            assert ratio[:, 0].tolist() == [1.0, 1.0, 0.0] and st["masked_frac"] == pytest.approx(1 / 3)
        if mode == "token_mask":  # 3 masked by the clip + 2 non-finite, of 9 trainable tokens
            assert st["masked_frac"] == pytest.approx(5 / 9) and st["clipped_frac"] == pytest.approx(3 / 9)
    # exempt rows: ratio 1, out of the statistics
    ratio, st, _ = is_ratio_masks(old, beh, mask, "sequence_mask", None, 3.0, exempt=torch.tensor([0, 0, 1]))
    assert ratio[2, 0] == 1.0 and st["masked_frac"] == 0.0


def test_resolve_row_reasons():
    base = {"episode_id": "e", "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
            "logprobs_mode": "processed", "input_ids": list(range(10)), "loss_mask": [0] * 4 + [1] * 6,
            "prompt_len": 4}
    kw = dict(trainer_temperature=0.6, served_default_temperature=0.6, is_correction=True, max_realign_share=0.5)
    assert resolve_row(base, **kw)[0] == Transform(0.6, 20, 0.95)
    cases = {"greedy": {"temperature": 0.0}, "temperature_mismatch": {"temperature": 0.7},
             "logprobs_raw": {"logprobs_mode": "raw"}, "logprobs_unknown": {"logprobs_mode": None},
             "sampling_unsupported": {"sampling_unsupported": "presence_penalty=0.5"},
             "unknown_truncation": {"top_p": None}, "realign_share": {"realign_tokens": 6}}
    for reason, over in cases.items():
        t, why, detail = resolve_row({**base, **over}, **kw)
        assert t is None and why == reason and detail, (reason, why, detail)
    assert resolve_row({**base, "realign_tokens": 5}, **kw)[1] == ""  # 50%: not above the gate
    assert "--temperature 0.7" in resolve_row({**base, "temperature": 0.7}, **kw)[2]


def test_ledger_window_and_message():
    led = ExclusionLedger(0.5, window=100)
    led.add(60, {"greedy": 60}, details={"greedy": "sampled greedily"})
    led.check()  # window not full yet
    led.add(60, {})
    led.check()  # 60 of 120
    led.add(100, {"logprobs_raw": 80}, details={"logprobs_raw": "raw"})  # the window slides to the last 100+
    with pytest.raises(ExcludedShareError, match=r"logprobs_raw: .*Fix: start the server with processed logprobs"):
        led.check()
    assert led.excluded_tokens == {"greedy": 60, "logprobs_raw": 80} and led.tokens == 220


# -- the trainer -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3(tiny_dir):
    return Sampler(tiny_dir, seed=5, temperature=0.6, top_k=20, top_p=0.95)


def test_rows_that_used_to_abort_are_counted(tmp_path, tiny_dir, qwen3):
    """raw, unknown (null) mode, a temperature mismatch and a greedy row, each in its own group: each
    episode is excluded and counted; every group trains on its other two episodes."""
    rows = (group(qwen3, "raw", first={"logprobs_mode": "raw"}) + group(qwen3, "null", first={"logprobs_mode": None})
            + group(qwen3, "temp", first={"temperature": 0.8}) + group(qwen3, "greedy", first={"temperature": 0.0}))
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6, per_device_train_batch_size=8))
    t.train()
    assert dict(t.shard_rollout.stats.rows_excluded) == {"logprobs_raw": 1, "logprobs_unknown": 1,
                                                         "temperature_mismatch": 1, "greedy": 1}
    out = t.gens[0]
    assert out["completion_ids"].size(0) == 8  # every group trained on its two other episodes
    st = out["is_stats"]
    assert st["logp_diff_max"] < 1e-3 and st["masked_frac"] == 0.0, st
    for reason in ("logprobs_raw", "logprobs_unknown", "temperature_mismatch", "greedy"):
        assert logged(t, f"polar/excluded_rows_total/{reason}") == [1]
        assert logged(t, f"polar/excluded_tokens_total/{reason}")[0] == 5
    share = logged(t, "polar/excluded_share")[0]
    assert share == pytest.approx(4 / 12)


def test_threshold_stop_names_cause_and_fix(tmp_path, tiny_dir, qwen3):
    rows = [dict(r, logprobs_mode="raw") for g in range(3) for r in group(qwen3, f"r{g}", n=2)]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6, excluded_share_window=15,
                                 max_excluded_share=0.5))
    with pytest.raises(ExcludedShareError, match=r"100\.0% of the last 20 trainable tokens were excluded.*"
                                                 r"logprobs_raw: 100\.0%.*Fix: start the server with processed "
                                                 r"logprobs: `vllm serve \.\.\. --logprobs-mode processed_logprobs`"):
        t.train()


def test_bf16_trainer_numerics_keep_every_sequence(tmp_path, tiny_dir, qwen3):
    """The trainer's weights round-tripped through bf16 (logits no longer the server's bit for bit):
    every on-policy sequence keeps a ratio near 1, no token is -inf, the fix share is logged."""
    rows = [r for g in range(4) for r in group(qwen3, f"b{g}", n=2)]
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6, per_device_train_batch_size=8))
    with torch.no_grad():
        for p in t.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    t.train()
    st = t.gens[0]["is_stats"]
    assert st["min"] > 0.5 and st["max"] < 2.0 and st["masked_frac"] == 0.0 and st["nonfinite_tokens"] == 0, st
    assert len(logged(t, "polar/is_kept_set_fix_share")) == 1
    assert logged(t, "polar/is_nonfinite_tokens") == [0.0]


def test_nonfinite_behaviour_logprobs_are_masked_per_token(tmp_path, tiny_dir, qwen3):
    rows = [r for g in range(2) for r in group(qwen3, f"n{g}", n=2)]
    p = rows[0]["prompt_len"]
    rows[0] = dict(rows[0], logprobs=rows[0]["logprobs"][:p + 1] + [float("-inf")] + rows[0]["logprobs"][p + 2:])
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6))
    t.train()
    out = t.gens[0]
    assert out["tool_mask"][0].tolist()[:5] == [1, 0, 1, 1, 1]  # the one token left the loss
    st = out["is_stats"]
    assert st["nonfinite_tokens"] == 1 and all(math.isfinite(v) for v in st.values()) and st["min"] > 0.99, st
    assert logged(t, "polar/is_nonfinite_tokens") == [1.0]
    assert t.exclusions.excluded_tokens == {"nonfinite_logprob": 1}


def test_realign_gate_and_no_correction_below_it(tmp_path, tiny_dir, qwen3):
    """A row re-rendered beyond max_realign_share: its episode excluded (counted). A row below it: no IS
    correction (its ratio on a context the server never saw would be 1/e^2 per token here)."""
    a = group(qwen3, "over", first={"realign_tokens": 10_000, "realign_classes": ["thinking-dropped"]})
    b = group(qwen3, "under", n=2, first={"realign_tokens": 3, "realign_classes": ["thinking-dropped"]})
    p = b[0]["prompt_len"]
    b[0] = dict(b[0], logprobs=b[0]["logprobs"][:p] + [x + 2.0 for x in b[0]["logprobs"][p:]])
    write_shard(tmp_path / "shards", 1, a + b)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6, max_realign_share=0.5))
    t.train()
    assert dict(t.shard_rollout.stats.rows_excluded) == {"realign_share": 1}
    out = t.gens[0]
    adv = out["advantages"]
    assert adv.shape == (4, 1) and (adv[2:] != 0).all()  # "under": the shifted row kept its advantage
    assert logged(t, "polar/is_realign_exempt_rows") == [1]
    assert logged(t, "polar/is_realign_exempt_token_share") == [pytest.approx(5 / 20)]
    assert logged(t, "polar/excluded_rows_total/realign_share") == [1]


def test_versions_incomplete_groups_and_metrics_in_log_history(tmp_path, tiny_dir, qwen3):
    """Null versions are counted (no sync history: the lag has no order, counted too), incomplete groups
    are dropped by default, and the counters are in TRL's log history."""
    rows = (group(qwen3, "nul", n=2, weight_version=None) + group(qwen3, "ok", n=2)
            + [dict(r, group_complete=False) for r in group(qwen3, "late", n=2)] + group(qwen3, "ok2", n=2))
    write_shard(tmp_path / "shards", 1, rows)
    cfg = config(tmp_path, learning_rate=0.0, temperature=0.6, per_device_train_batch_size=6)
    assert cfg.drop_incomplete_groups and cfg.max_policy_lag == 4 and cfg.max_excluded_share == 0.5
    t = trainer(tiny_dir, cfg)
    t.train()
    h = next(x for x in t.state.log_history if "polar/rows_null_version_total" in x)
    assert h["polar/rows_null_version_total"] == 2
    assert h["polar/groups_dropped_total/incomplete"] == 1
    # data versions "1" (polar-serve counters) order the groups: the null rows count as the oldest (lag 1)
    assert h["polar/policy_lag"] == pytest.approx(1 / 3)
    for key in ("sampling/importance_sampling_ratio/masked_frac", "sampling/importance_sampling_ratio/clipped_frac",
                "sampling/sampling_logp_difference/mean", "polar/is_kept_set_fix_share", "polar/excluded_share",
                "polar/is_nonfinite_frac", "polar/excluded_rows_total/greedy", "polar/groups_lag_unknown_total"):
        assert key in h and math.isfinite(h[key]), key
