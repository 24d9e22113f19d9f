"""Per-episode GRPO advantages (trainer/advantages.py): a hand-derived batch, TRL's own formula where
every episode is one row in blocks of G (the two must agree), and properties on generated batches:
row order does not matter, and splitting an episode into k segments changes nothing."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.trainer.utils import nanstd

from trainer.advantages import EPS, episode_advantages


def test_hand_derived_reference():
    # Group A: episodes a1 (reward 1, THREE segments), a2 (0), a3 (0). Per episode: mean 1/3,
    # std (Bessel) sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3). Per row (TRL's way) a1 would count 3 times.
    groups = ["A"] * 5 + ["A"] * 3  # 5 real rows, then 3 padding rows (episode None)
    eps = ["a1", "a1", "a1", "a2", "a3", None, None, None]
    r = [[1.0], [1.0], [1.0], [0.0], [0.0], [math.nan], [math.nan], [math.nan]]
    adv = episode_advantages(groups, eps, r, [1.0])
    s = math.sqrt(1 / 3)
    want_hi, want_lo = (2 / 3) / (s + EPS), (-1 / 3) / (s + EPS)
    assert adv[:3] == pytest.approx([want_hi] * 3)
    assert adv[3:5] == pytest.approx([want_lo] * 2)
    assert adv[5:] == [0.0, 0.0, 0.0]
    # scale_rewards none: differences only; batch: one std over every episode of the batch.
    assert episode_advantages(groups, eps, r, [1.0], "none")[:4] == pytest.approx([2 / 3] * 3 + [-1 / 3])
    g2 = groups + ["B", "B"]
    e2, r2 = eps + ["b1", "b2"], r + [[0.5], [0.5]]
    batch = episode_advantages(g2, e2, r2, [1.0], "batch")
    sb = float(nanstd(torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5])))
    assert batch[0] == pytest.approx((2 / 3) / (sb + EPS)) and batch[-1] == 0.0
    # One episode in a group: nothing to compare with, advantage 0 (TRL: std NaN -> 0).
    assert episode_advantages(["C", "C"], ["c", "c"], [[1.0], [1.0]], [1.0]) == [0.0, 0.0]


def trl_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, g: int, scale: str, agg: str):
    """TRL 1.16's formula (GRPOTrainer._generate_and_score_completions), rows in blocks of g."""
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if agg == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g)
        std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g) if scale != "batch" else \
            nanstd(rewards).expand_as(rewards)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, g, rewards_per_func.size(1))
        mk, sk = torch.nanmean(grouped, dim=1, keepdim=True), nanstd(grouped, dim=1, keepdim=True)
        rk = ((grouped - mk) / (sk + 1e-4)).view(-1, rewards_per_func.size(1))
        rewards = (rk * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        adv = (rewards - torch.nanmean(rewards)) / (nanstd(rewards) + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


rewards_st = st.floats(-3, 3, allow_nan=False).map(lambda x: round(x, 3))


@st.composite
def batches(draw):
    """Groups of episodes, each with a reward per function (some None), and a segment count."""
    n_funcs = draw(st.integers(1, 2))
    groups = []
    for gi in range(draw(st.integers(1, 4))):
        eps = []
        for ei in range(draw(st.integers(1, 5))):
            r = [draw(st.one_of(rewards_st, st.just(math.nan))) if f else draw(rewards_st) for f in range(n_funcs)]
            eps.append((f"g{gi}", f"g{gi}-e{ei}", r, draw(st.integers(1, 3))))
        groups.append(eps)
    weights = [draw(st.sampled_from([1.0, 0.5, 2.0])) for _ in range(n_funcs)]
    return groups, weights


def flatten(groups, split: bool):
    rows = [(g, e, r) for eps in groups for g, e, r, k in eps for _ in range(k if split else 1)]
    return [x[0] for x in rows], [x[1] for x in rows], [x[2] for x in rows]


MODES = [("group", "sum_then_normalize"), ("batch", "sum_then_normalize"), ("none", "sum_then_normalize"),
         ("group", "normalize_then_sum")]


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(MODES), st.randoms(use_true_random=False))
def test_properties(batch, mode, rnd):
    groups, weights = batch
    scale, agg = mode
    g, e, r = flatten(groups, split=True)
    adv = episode_advantages(g, e, r, weights, scale, agg)
    # Every segment of an episode gets the same advantage.
    per_ep: dict = {}
    for key, a in zip(zip(g, e), adv):
        per_ep.setdefault(key, set()).add(a)
    assert all(len(v) == 1 for v in per_ep.values())
    # Split into k segments == unsplit.
    g1, e1, r1 = flatten(groups, split=False)
    unsplit = dict(zip(zip(g1, e1), episode_advantages(g1, e1, r1, weights, scale, agg)))
    assert {k: v.pop() for k, v in per_ep.items()} == pytest.approx(unsplit, abs=1e-9)
    # Row order does not matter.
    order = list(range(len(g)))
    rnd.shuffle(order)
    shuffled = episode_advantages([g[i] for i in order], [e[i] for i in order], [r[i] for i in order],
                                  weights, scale, agg)
    assert shuffled == pytest.approx([adv[i] for i in order], abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(batches(), st.sampled_from(MODES))
def test_one_row_per_episode_equals_trl(batch, mode):
    """With one row per episode and every group padded to G rows (padding: all rewards None), the
    per-episode advantages are exactly TRL's."""
    groups, weights = batch
    scale, agg = mode
    gsize = max(len(eps) for eps in groups)
    g, e, r = [], [], []
    n_funcs = len(weights)
    for eps in groups:
        for gid, eid, rew, _ in eps:
            g.append(gid), e.append(eid), r.append(rew)
        for _ in range(gsize - len(eps)):
            g.append(eps[0][0]), e.append(None), r.append([math.nan] * n_funcs)
    ours = episode_advantages(g, e, r, weights, scale, agg)
    ref = trl_advantages(torch.tensor(r, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64), gsize,
                         scale, agg)
    assert ours == pytest.approx(ref.tolist(), abs=1e-6)


def test_bad_modes():
    with pytest.raises(ValueError, match="scale_rewards"):
        episode_advantages(["A"], ["a"], [[1.0]], [1.0], "sometimes")
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        episode_advantages(["A"], ["a"], [[1.0]], [1.0], "group", "average")
