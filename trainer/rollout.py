"""Turn shard groups into the rows TRL's ``rollout_func`` must return.

TRL's contract: ``rollout_func(prompts, trainer)`` gets the sampler's prompts already repeated
``num_generations`` (G) times and returns exactly ``len(prompts)`` rows; consecutive runs of G
rows form one GRPO group (``rewards.view(-1, G)``). The prompts are placeholders here: the shard
stream decides what is trained.

One shard row (a segment) -> one TRL row:
    prompt_ids     = input_ids[:prompt_len]          (up to the first trainable token)
    completion_ids = input_ids[prompt_len:]
    env_mask       = loss_mask[prompt_len:]          (0 on tool/harness tokens inside the span)
    logprobs       = logprobs[prompt_len:]           (behaviour logprobs; 0.0 where env_mask is 0)
    reward         = the episode's reward            (consumed by ``shard_reward``)

Groups whose row count differs from G (choice documented in the README and in PolarGRPOConfig):
- Multi-segment episodes: each segment is its own row and carries its episode's reward, so an
  episode of k segments counts k times in its group's mean/std (the same as k samples would).
- policy "pad" (default): episodes are taken whole, in the order they appear in the shard,
  skipping any that would overflow G rows; the rest of the G rows are padding rows (a copy of the
  first kept row's prompt plus one token, env_mask 0, reward None). TRL treats a row whose every
  reward is None as unscorable: NaN reward, left out of the group baseline, advantage 0; with
  env_mask 0 it also adds no token to the loss or to its normaliser. A group in which fewer than
  two episodes fit is skipped (no baseline to compare against).
- policy "skip": any group whose row count is not exactly G is skipped.
Every skip and pad is counted and logged.

Sampling (with importance-sampling correction on; trainer/sampling.py): every row's transform (the
distribution its recorded logprobs reflect) is resolved from its columns by ``resolve_sampling``,
which refuses raw/unknown logprob modes (LogprobsModeError) and excludes whole episodes containing a
row the trainer cannot reproduce (``sampling_unsupported``, unknown top_k/top_p/min_p), with the
reason; the rest of the group is fitted as above. Each TRL row carries its transform (``transform``,
not forwarded to TRL: ShardRollout hands the list to the trainer's old-policy hook, in rollout order).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from trainer.sampling import row_transform
from trainer.shard_source import Group

POLICIES = ("pad", "skip")
ROW_KEYS = ("prompt_ids", "completion_ids", "env_mask", "logprobs", "reward", "episode_id", "group_id",
            "segment", "weight_version", "polar_pad")


def segment_row(row: dict) -> dict:
    p = row["prompt_len"]
    ids = list(row["input_ids"])
    return {
        "prompt_ids": ids[:p],
        "completion_ids": ids[p:],
        "env_mask": [int(x) for x in row["loss_mask"][p:]],
        "logprobs": [float(x) for x in row["logprobs"][p:]],
        "reward": None if row["reward"] is None else float(row["reward"]),
        "episode_id": row["episode_id"],
        "group_id": row["group_id"],
        "segment": int(row["segment"]),
        "weight_version": row.get("weight_version"),
        "polar_pad": False,
        "transform": row.get("polar_transform"),  # set by resolve_sampling; None without IS correction
    }


def pad_row(like: dict) -> dict:
    """A row that trains nothing and is left out of its group's baseline."""
    return {**like, "completion_ids": like["completion_ids"][:1], "env_mask": [0], "logprobs": [0.0],
            "reward": None, "episode_id": None, "segment": -1, "polar_pad": True}


def fit_group(group: Group, g: int, policy: str = "pad") -> tuple[list[dict] | None, str]:
    """Exactly g rows for this group, or (None, reason) when it must be skipped."""
    if policy not in POLICIES:
        raise ValueError(f"unknown group size policy {policy!r}; expected one of {POLICIES}")
    rows = [segment_row(r) for r in group.rows]
    if len(rows) == g:
        return rows, ""
    if policy == "skip":
        return None, f"{len(rows)} rows != num_generations {g}"
    by_episode: dict[str, list[dict]] = {}
    for r in rows:
        by_episode.setdefault(r["episode_id"], []).append(r)
    kept: list[dict] = []
    n_eps = 0
    for ep_rows in by_episode.values():
        if len(kept) + len(ep_rows) <= g:
            kept += ep_rows
            n_eps += 1
    if n_eps < 2:
        return None, f"fewer than 2 whole episodes fit in num_generations={g} rows ({len(by_episode)} episodes, {len(rows)} rows)"
    note = f"kept {n_eps}/{len(by_episode)} episodes, {len(kept)}/{len(rows)} rows, padded {g - len(kept)}"
    return kept + [pad_row(kept[0]) for _ in range(g - len(kept))], note


def resolve_sampling(group: Group, served_default_temperature: float) -> tuple[Group, list[tuple[str, int, str]]]:
    """The group without the episodes the trainer cannot reproduce, every kept row carrying its
    transform (``polar_transform``), and [(episode_id, rows excluded, reason)]. Raises
    LogprobsModeError (trainer/sampling.py) for a raw or unknown logprob mode."""
    reasons: dict[str, str] = {}
    rows = []
    for i, r in enumerate(group.rows):
        t, why = row_transform(r, served_default_temperature, f"{group.shard} group {group.group_id} row {i}")
        if t is None:
            reasons.setdefault(r["episode_id"], why)
        rows.append({**r, "polar_transform": t})
    kept = [r for r in rows if r["episode_id"] not in reasons]
    excluded = [(ep, sum(r["episode_id"] == ep for r in rows), why) for ep, why in reasons.items()]
    return replace(group, rows=kept), excluded


@dataclass
class RolloutStats:
    groups: int = 0
    rows_padded: int = 0
    rows_trimmed: int = 0
    skipped: Counter = field(default_factory=Counter)
    rows_excluded: Counter = field(default_factory=Counter)  # by reason: sampling the trainer cannot reproduce
    # Per batch, reset by the trainer when it logs them.
    landing_latency: list[float] = field(default_factory=list)
    policy_lag: list[float] = field(default_factory=list)


def rows_to_columns(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in ROW_KEYS}
