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
from trainer.behaviour_logprobs import (
    BOUNDARY_TOL,
    LOGIT_TOL,
    Transform,
    cut_slack,
    mask_logits_,
    sampled_token_logprobs,
    token_logprobs,
)
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

CUTS = [Transform(0.6, 20, 0.95), Transform(0.6, -1, 0.9), Transform(0.6, -1, 1.0, 0.05), Transform(1.0, 50, 0.9, 0.05),
        Transform(0.6, 20, 1.0)]


@pytest.mark.parametrize("t", CUTS, ids=str)
def test_every_token_the_server_kept_within_logit_tol_is_scored(t):
    """The guarantee of the cut-based rule: the server's logits within LOGIT_TOL of the trainer's, any
    token the server's set kept (here the weakest one, at the cut) gets a finite pi_old from the trainer,
    whichever truncation cut it: the top_k rank, the top_p mass or the min_p ratio."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(512, 300, generator=g) * 3
    server = logits + (torch.rand(logits.shape, generator=g) * 2 - 1) * LOGIT_TOL * 0.999
    zs = mask_logits_(server / t.temperature, t)
    weakest = torch.where(torch.isfinite(zs), zs, math.inf).argmin(-1)  # the server's kept token at its cut
    lp, added = sampled_token_logprobs(logits, weakest, t)
    assert torch.isfinite(lp).all(), f"{int((~torch.isfinite(lp)).sum())} kept tokens scored -inf"
    assert bool(added.any())  # the fixture crosses the cuts: the rule is exercised
    old = token_logprobs(logits, weakest, t, keep_sampled=False)
    assert torch.isneginf(old[added]).all() and torch.equal(old[~added], lp[~added])


def test_a_sampled_token_at_the_cut_is_kept_and_one_far_outside_is_not():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 200, generator=g) * 2
    t = Transform(0.6, 20, 0.95)
    z = logits / 0.6
    kept = torch.isfinite(mask_logits_(z.clone(), t))
    inside = torch.stack([row.nonzero()[0, 0] for row in kept])  # a kept token per position
    # the strongest token the trainer dropped, and the least likely one
    near = torch.where(kept, -math.inf, z).argmax(-1)
    slack = cut_slack(z, near[:, None], t).squeeze(-1)
    rows = (slack <= BOUNDARY_TOL / 0.6).nonzero().squeeze(-1)
    assert len(rows) >= 16, "the fixture must have tokens at the cut to test"
    lp, added = sampled_token_logprobs(logits[rows], near[rows], t)
    assert bool(added.all()) and torch.isfinite(lp).all()
    # renormalised over the trainer's kept set plus the sampled token
    want = torch.stack([torch.where(kept[i] | (torch.arange(200) == near[i]), z[i], -math.inf).log_softmax(-1)[near[i]]
                        for i in rows.tolist()])
    assert torch.allclose(lp, want, atol=1e-5)
    # far outside the set: not numerics but a row whose tokens do not fit its logprobs: -inf (masked, counted)
    far = z.argmin(-1)
    assert bool((cut_slack(z, far[:, None], t) > BOUNDARY_TOL / 0.6).all())
    lp_far, added_far = sampled_token_logprobs(logits, far, t)
    assert not bool(added_far.any()) and torch.isneginf(lp_far).all()
    lp_in, added_in = sampled_token_logprobs(logits, inside, t)
    assert not bool(added_in.any()) and torch.isfinite(lp_in).all()
    assert bool((cut_slack(z, inside[:, None], t) <= 0).all())
    old = token_logprobs(logits[rows], near[rows], t, keep_sampled=False)  # the old rule
    assert torch.isneginf(old).all()
    # tokens inside the set: the same value under both rules (the exact vLLM distribution)
    assert torch.equal(token_logprobs(logits, inside, t), token_logprobs(logits, inside, t, keep_sampled=False))



@pytest.mark.parametrize("t", [Transform(1.0, -1, 1.0, 0.05), Transform(1.0, 50, 1.0), Transform(0.6, 20, 0.95, 0.05)],
                         ids=str)
def test_cuts_on_the_servers_precision(t):
    """A bf16 server cuts on bf16 logits (min_p's threshold lands on the bf16 grid, top_k keeps the grid's
    ties); with ``cut_dtype=torch.bfloat16`` an fp32 trainer whose logits round to the server's makes the very
    same cut, so its pi_old is the server's kept set renormalised, for every token the server kept; cutting
    on its fp32 logits it disagrees at some positions (what the option is for)."""
    g = torch.Generator().manual_seed(2)
    v = 2000
    # rank-log logits of a trained LM's size (the bf16 step 0.125 at 16-32), ids shuffled
    logits = (24 - 2 * torch.arange(1, v + 1).float().log() + 0.3 * torch.randn(256, v, generator=g))
    logits = logits[:, torch.randperm(v, generator=g)]
    server = mask_logits_(logits.bfloat16().float() / t.temperature, t)
    kept = torch.isfinite(server)
    pos, tok = kept.nonzero(as_tuple=True)
    pi_s = (logits / t.temperature).masked_fill(~kept, -math.inf).log_softmax(-1)[pos, tok]
    lp, added = sampled_token_logprobs(logits[pos], tok, t, cut_dtype=torch.bfloat16)
    assert not bool(added.any()) and torch.allclose(lp, pi_s, atol=1e-5)
    fp32_kept = torch.isfinite(mask_logits_(logits / t.temperature, t))
    assert bool((fp32_kept != kept).any(-1).any()), "the fixture must put tokens on the grid's side of a cut"
    lp32 = token_logprobs(logits[pos], tok, t)
    assert not torch.allclose(lp32, pi_s, atol=1e-5)
    # the server's own precision: rounding bf16 logits to bf16 changes nothing
    same = logits.bfloat16()
    assert torch.equal(token_logprobs(same[pos], tok, t, cut_dtype=torch.bfloat16), token_logprobs(same[pos], tok, t))


def test_cut_slack_per_truncation():
    z = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    tok = torch.tensor([[3]])
    # top_k 2: the k-th largest is 3.0, the token 1.0: 2.0 outside
    assert cut_slack(z, tok, Transform(1.0, 2)).item() == pytest.approx(2.0)
    # min_p 0.1: kept iff z - z_max >= ln 0.1 = -2.303; the token sits at -3: 0.697 outside
    assert cut_slack(z, tok, Transform(1.0, min_p=0.1)).item() == pytest.approx(math.log(0.1) + 3.0)
    # top_p 0.9: the mass above the token / the total, against 0.9, in log
    p = z.softmax(-1)[0]
    assert cut_slack(z, tok, Transform(1.0, top_p=0.9)).item() == pytest.approx(math.log(p[:3].sum() / 0.9), abs=1e-6)
    assert cut_slack(z, torch.tensor([[0]]), Transform(1.0, 2, 0.9, 0.1)).item() <= 0  # the top token: inside


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
        if mode == "sequence_mask":  # row 2: exp(12) > 3, masked; rows 0 and 1 fail whole (a token not finite)
            assert ratio[:, 0].tolist() == [0.0, 0.0, 0.0] and st["masked_frac"] == 1.0
        if mode == "token_mask":  # 3 masked by the clip + 2 non-finite, of 9 trainable tokens
            assert st["masked_frac"] == pytest.approx(5 / 9) and st["clipped_frac"] == pytest.approx(3 / 9)
    # exempt rows: ratio 1, out of the statistics
    ratio, st, _ = is_ratio_masks(old, beh, mask, "sequence_mask", None, 3.0, exempt=torch.tensor([0, 0, 1]))
    assert ratio[2, 0] == 1.0 and st["masked_frac"] == 1.0  # rows 0 and 1 (failed) are the statistics
    ratio, st, _ = is_ratio_masks(old, beh, mask, "sequence_mask", None, 3.0, exempt=torch.tensor([1, 1, 1]))
    assert ratio[:, 0].tolist() == [1.0, 1.0, 1.0] and st == {"nonfinite_tokens": 2.0, "nonfinite_frac": 2 / 9,
                                                              "lost_token_share": 2 / 9, "vanishing_weight_share": 0.0}


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


@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_nonfinite_behaviour_logprobs_are_masked_and_counted(tmp_path, tiny_dir, qwen3, mode):
    """A -inf behaviour logprob: the token leaves the loss; in a token mode it alone is lost, in a sequence
    mode its whole sequence is (ratio 0, as TRL's -inf sum and slime's veto); either way every lost token
    is counted in the exclusion ledger."""
    rows = [r for g in range(2) for r in group(qwen3, f"n{g}", n=2)]
    p = rows[0]["prompt_len"]
    rows[0] = dict(rows[0], logprobs=rows[0]["logprobs"][:p + 1] + [float("-inf")] + rows[0]["logprobs"][p + 2:])
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6, vllm_importance_sampling_mode=mode))
    t.train()
    out = t.gens[0]
    assert out["tool_mask"][0].tolist()[:5] == [1, 0, 1, 1, 1]  # the one token left the loss
    st = out["is_stats"]
    assert st["nonfinite_tokens"] == 1 and all(math.isfinite(v) for v in st.values()), st
    assert logged(t, "polar/is_nonfinite_tokens") == [1.0]
    adv = out["advantages"]
    if mode == "token_truncate":
        assert st["masked_frac"] == pytest.approx(1 / 20) and adv[0, 1] == 0 and (adv[0, [0, 2, 3, 4]] != 0).all()
        assert t.exclusions.excluded_tokens == {"nonfinite_logprob": 1}
    else:
        assert st["masked_frac"] == pytest.approx(1 / 4) and adv[0, 0] == 0 and (adv[1:] != 0).all()
        assert t.exclusions.excluded_tokens == {"nonfinite_logprob": 5}  # the whole row, counted
    assert logged(t, "polar/excluded_tokens_total/nonfinite_logprob") == [t.exclusions.excluded_tokens["nonfinite_logprob"]]
    assert logged(t, "polar/is_lost_token_share") == [pytest.approx(t.exclusions.excluded_tokens["nonfinite_logprob"] / 20)]


def test_masked_sequences_are_counted_and_the_stop_sees_them(tmp_path, tiny_dir, qwen3):
    """sequence_mask with a band the rows miss: every zeroed sequence's tokens are counted by reason in the
    ledger, so the excluded share rises and max_excluded_share stops the run naming the cause."""
    rows = [r for g in range(2) for r in group(qwen3, f"m{g}", n=2)]
    p = rows[0]["prompt_len"]
    rows = [dict(r, logprobs=r["logprobs"][:p] + [x - 1.0 for x in r["logprobs"][p:]]) for r in rows]  # ratio e^5
    write_shard(tmp_path / "shards", 1, rows)
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6, vllm_importance_sampling_mode="sequence_mask",
                                 excluded_share_window=10, max_excluded_share=0.5))
    t.train()
    assert t.exclusions.excluded_tokens == {"is_ratio_high": 20} and t.exclusions.share == 1.0
    assert logged(t, "polar/excluded_tokens_total/is_ratio_high") == [20]
    with pytest.raises(ExcludedShareError, match=r"is_ratio_high: 100.0% .*Fix: the importance ratio exceeded"):
        t.exclusions.check()


def test_realign_gate_and_no_correction_below_it(tmp_path, tiny_dir, qwen3):
    """A row re-rendered beyond max_realign_share: its episode excluded (counted). A row below it is
    corrected on its own context (realign_is=correct, the default: ratio 1/e^2 per token here) and keeps
    a non-zero weight; it is counted as realigned, not as exempt."""
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
    assert (adv[2:] != 0).all()  # "under": the shifted row kept its advantage
    assert logged(t, "polar/is_realign_rows") == [1]  # realigned, corrected (realign_is=correct): none exempt
    assert logged(t, "polar/is_realign_token_share") == [pytest.approx(5 / 20)]
    assert logged(t, "polar/is_realign_exempt_rows") == [0] and logged(t, "polar/is_realign_exempt_token_share") == [0]
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


def test_off_policy_sequence_mask_is_refused_on_truncated_rows(tmp_path, tiny_dir, qwen3):
    """TRL's OPSM reads mean(log mu - log pi_full): on truncated rows that is the kept mass, not staleness."""
    with pytest.raises(ValueError, match="off_policy_mask_threshold .*truncated"):
        config(tmp_path, off_policy_mask_threshold=0.5, vllm_importance_sampling_correction=False)
    write_shard(tmp_path / "shards", 1, [r for g in range(2) for r in group(qwen3, f"o{g}", n=2)])
    t = trainer(tiny_dir, config(tmp_path, learning_rate=0.0, temperature=0.6, off_policy_mask_threshold=0.5))
    with pytest.raises(ValueError, match=r"off_policy_mask_threshold 0.5 .* 4 of 4 rows sampled with truncation "
                                         r"\(T=0.6 top_k=20 top_p=0.95 min_p=0\).*kept mass"):
        t.train()


def test_default_mode_is_token_truncate():
    from trainer.grpo_config import PolarGRPOConfig

    f = PolarGRPOConfig.__dataclass_fields__
    assert f["vllm_importance_sampling_mode"].default == "token_truncate"
    assert f["vllm_importance_sampling_clip_max"].default == 3.0 and f["vllm_importance_sampling_clip_min"].default is None


def test_ledger_late_counts_stay_with_their_batch():
    """Tokens the trainer zeroes after reading a batch are merged with that batch's groups in the window:
    the share never exceeds what the window read, even when the batch is larger than the window."""
    led = ExclusionLedger(0.5, window=10)
    led.add(10, {})
    led.add(10, {"greedy": 2})  # the window (10 tokens) slid past the first group
    led.add_late({"is_ratio_high": 10}, {"is_ratio_high": "10 of 20"})  # found in both groups
    assert led.share == pytest.approx(12 / 20) and led.excluded_tokens == {"greedy": 2, "is_ratio_high": 10}
    with pytest.raises(ExcludedShareError, match=r"of the last 20 trainable tokens.*is_ratio_high: 50.0% \(10 of 20\)"):
        led.check()
    led.add(30, {})
    led.add_late({})  # a clean batch closes too
    assert led.share == 0.0 and led.tokens == 50
