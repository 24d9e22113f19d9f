"""GRPO advantages over episodes, not rows (sans-IO; grpo_trainer.py applies them in its hook).

A group (one task) holds episodes; an episode may be several rows (segments: a FORK, a sub-agent, a
compaction, an n>1 choice). TRL normalises rewards over each block of ``num_generations`` rows, so an
episode of k segments would count k times in its group's mean and std, and a group laid out over
several blocks (shard_rollout.py) would be split. Here the unit is the episode, keyed by
(``group_id``, ``episode_id``); padding rows (``episode_id`` None) are no episode.

Episode reward: the rows' rewards as TRL combines them (``rewards_per_func`` weighted by
``reward_weights``), averaged over the episode's scorable rows (``shard_reward`` gives every row of an
episode the episode's reward, so the mean is that reward; a further reward function scoring rows
differently contributes its mean over the episode). An episode whose every row is unscorable (all
None) has no reward, takes no part in any baseline and gets advantage 0, as TRL treats such a row.

Then TRL's formulas (trl 1.16 ``GRPOTrainer._generate_and_score_completions``), with episodes in
place of rows and each group's episodes in place of its ``num_generations`` rows:
- ``multi_objective_aggregation="sum_then_normalize"`` (default):
  ``A_e = R_e - mean_{group}(R)``, then divided by ``std + 1e-4`` where std is, by ``scale_rewards``:
  ``"group"``: the std of the group's episode rewards; ``"batch"``: the std of every episode reward in
  the (all-rank) generation batch; ``"none"``: not divided.
- ``"normalize_then_sum"``: per reward function, ``(r_e - mean_group) / (std_group + 1e-4)``, the
  weighted sum over functions, then ``(x - mean_batch) / (std_batch + 1e-4)`` over every episode.
std is TRL's ``nanstd`` (Bessel-corrected; NaN for a single value, which makes that group's
advantages 0: one episode has nothing to be compared with). Every row of an episode gets the
episode's advantage; padding rows 0.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

EPS = 1e-4  # TRL's


def nanstd(xs: Sequence[float]) -> float:
    v = [x for x in xs if not math.isnan(x)]
    if len(v) < 2:
        return math.nan
    m = sum(v) / len(v)
    return math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1))


def nanmean(xs: Sequence[float]) -> float:
    v = [x for x in xs if not math.isnan(x)]
    return sum(v) / len(v) if v else math.nan


def episode_rewards(keys: Sequence[Hashable | None], rewards: Sequence[Sequence[float]]) -> dict:
    """{episode key: [reward per function]} (each the nanmean over the episode's rows); rows with key None skipped."""
    rows: dict = {}
    for k, r in zip(keys, rewards, strict=True):
        if k is not None:
            rows.setdefault(k, []).append(r)
    return {k: [nanmean([r[f] for r in rs]) for f in range(len(rs[0]))] for k, rs in rows.items()}


def episode_advantages(groups: Sequence[Hashable], episodes: Sequence[Hashable | None],
                       rewards_per_func: Sequence[Sequence[float]], weights: Sequence[float],
                       scale_rewards: str = "group", aggregation: str = "sum_then_normalize") -> list[float]:
    """One advantage per row (module doc). ``groups``/``episodes``: per row; ``episodes[i]`` None marks a
    padding row. ``rewards_per_func``: per row, one value per reward function (NaN: None)."""
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards {scale_rewards!r} not in ('group', 'batch', 'none')")
    keys = [None if e is None else (g, e) for g, e in zip(groups, episodes, strict=True)]
    per_func = episode_rewards(keys, rewards_per_func)
    by_group: dict = {}
    for k in per_func:
        by_group.setdefault(k[0], []).append(k)
    adv: dict = {}
    if aggregation == "sum_then_normalize":
        total = {}
        for k, fs in per_func.items():
            terms = [w * x for w, x in zip(weights, fs, strict=True) if not math.isnan(x)]
            total[k] = sum(terms) if terms else math.nan  # all None: unscorable
        batch_std = nanstd(list(total.values()))
        for eps in by_group.values():
            vals = [total[k] for k in eps]
            mean, std = nanmean(vals), (batch_std if scale_rewards == "batch" else nanstd(vals))
            for k in eps:
                a = total[k] - mean
                if scale_rewards != "none":
                    a /= std + EPS
                adv[k] = a
    elif aggregation == "normalize_then_sum":
        norm: dict = {k: 0.0 for k in per_func}
        for eps in by_group.values():
            for f, w in enumerate(weights):
                vals = [per_func[k][f] for k in eps]
                mean, std = nanmean(vals), nanstd(vals)
                for k in eps:
                    x = (per_func[k][f] - mean) / (std + EPS)
                    if not math.isnan(x):  # TRL's nansum over functions
                        norm[k] += w * x
        for k, fs in per_func.items():
            if all(math.isnan(x) for x in fs):
                norm[k] = math.nan
        mean, std = nanmean(list(norm.values())), nanstd(list(norm.values()))
        adv = {k: (v - mean) / (std + EPS) for k, v in norm.items()}
    else:
        raise ValueError(f"multi_objective_aggregation {aggregation!r} not in ('sum_then_normalize', "
                         "'normalize_then_sum')")
    return [0.0 if k is None or math.isnan(adv[k]) else adv[k] for k in keys]
