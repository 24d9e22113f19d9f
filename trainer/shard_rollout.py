"""The shard rollout: shard groups turned into the rows TRL's ``rollout_func`` must return.

TRL's contract: ``rollout_func(prompts, trainer)`` gets the sampler's prompts already repeated
``num_generations`` (G) times and returns exactly ``len(prompts)`` rows; consecutive runs of G rows
form one GRPO group. The prompts are placeholders: the shard stream decides what is trained.

One shard row (a segment) -> one TRL row:
    prompt_ids     = input_ids[:prompt_len]          (up to the first trainable token)
    completion_ids = input_ids[prompt_len:]
    env_mask       = loss_mask[prompt_len:]          (0 on tool/harness tokens inside the span)
    logprobs       = logprobs[prompt_len:]           (behaviour logprobs; 0.0 where env_mask is 0)
    reward         = the episode's reward            (consumed by ``shard_reward``)

Group-size policies (pad, skip), exclusions (too long, sampling the trainer cannot reproduce),
truncation masking from the ``termination`` column, and why: docs/training.md ("Groups",
"Lengths and truncation", "Importance-sampling correction"). Every skip, pad, deferral and
exclusion is counted in RolloutStats and logged.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from polar_contracts.shards import TERMINATIONS, TRUNCATED
from trainer.behaviour_logprobs import Transform
from trainer.config_choices import GROUP_SIZE_POLICIES
from trainer.row_exclusions import ExclusionLedger, explain_excluded, resolve_row, trainable_tokens
from trainer.shard_source import Group, NoShardsError, ShardSource

log = logging.getLogger(__name__)

POLICIES = GROUP_SIZE_POLICIES  # the public name, kept
ROW_KEYS = ("prompt_ids", "completion_ids", "env_mask", "logprobs", "reward", "episode_id", "group_id",
            "segment", "weight_version", "polar_pad", "termination")


class GroupTooLarge(ValueError):
    """A group needs more rows than a whole generation batch holds."""


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
        "termination": row.get("termination"),
        "transform": row.get("polar_transform"),  # set by resolve_sampling; None without IS correction
        "realign_tokens": int(row.get("realign_tokens") or 0),
    }


def pad_row(like: dict) -> dict:
    """A row that trains nothing and is left out of its group's baseline."""
    return {**like, "completion_ids": like["completion_ids"][:1], "env_mask": [0], "logprobs": [0.0],
            "reward": None, "episode_id": None, "segment": -1, "polar_pad": True, "termination": None}


def fit_group(group: Group, g: int, policy: str = "pad") -> tuple[list[dict] | None, str]:
    """The group's rows laid out in whole blocks of g rows (a multiple of g, padding last), or
    (None, reason) when it must be skipped (module doc)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown group size policy {policy!r}; expected one of {POLICIES}")
    rows = [segment_row(r) for r in group.rows]
    if policy == "skip":
        return (rows, "") if len(rows) == g else (None, f"{len(rows)} rows != num_generations {g}")
    n_eps = len(group.episodes)
    if n_eps < 2:
        return None, f"{n_eps} episode(s) ({len(rows)} rows): no baseline to compare against"
    n = -(-len(rows) // g) * g
    note = "" if n == len(rows) else f"{n_eps} episodes, {len(rows)} rows in {n // g} block(s) of {g}, padded {n - len(rows)}"
    return rows + [pad_row(rows[0]) for _ in range(n - len(rows))], note


def exclude_too_long(group: Group, max_length: int | None) -> tuple[Group, list[tuple[str, int, str]]]:
    """The group without the episodes that have a row longer than ``max_length`` tokens, and
    [(episode_id, rows excluded, reason)]."""
    if max_length is None:
        return group, []
    long = {}
    for r in group.rows:
        if len(r["input_ids"]) > max_length:
            long.setdefault(r["episode_id"], f"a row of {len(r['input_ids'])} tokens > max_length {max_length}")
    if not long:
        return group, []
    excluded = [(ep, sum(r["episode_id"] == ep for r in group.rows), why) for ep, why in long.items()]
    return replace(group, rows=[r for r in group.rows if r["episode_id"] not in long]), excluded


def mask_truncated(rows: list[dict], eos_and_pad: set[int]) -> int:
    """Zero env_mask of every row whose episode ended by length/timeout (rows without a termination:
    TRL's rule, last completion id not EOS/pad). Returns how many rows it masked."""
    n = 0
    for r in rows:
        if r["polar_pad"]:
            continue
        t = r.get("termination")
        if t is not None and t not in TERMINATIONS:
            raise ValueError(f"episode {r['episode_id']}: termination {t!r} not in {TERMINATIONS}")
        cut = t in TRUNCATED if t is not None else r["completion_ids"][-1] not in eos_and_pad
        if cut:
            r["env_mask"] = [0] * len(r["env_mask"])
            n += 1
    return n


def resolve_sampling(group: Group, resolve) -> tuple[Group, list[tuple[str, int, str, str, int]]]:
    """The group without the episodes that have a row the trainer cannot train on, every kept row
    carrying its transform (``polar_transform``), and [(episode_id, rows, reason, detail, trainable
    tokens)] of the excluded episodes. ``resolve(row, where)`` is row_exclusions.resolve_row with the
    run's settings bound: (transform, reason, detail)."""
    reasons: dict[str, tuple[str, str]] = {}
    rows = []
    for i, r in enumerate(group.rows):
        t, reason, detail = resolve(r, f"{group.shard} group {group.group_id} row {i}")
        if reason:
            reasons.setdefault(r["episode_id"], (reason, detail))
        rows.append({**r, "polar_transform": t})
    kept = [r for r in rows if r["episode_id"] not in reasons]
    excluded = [(ep, sum(r["episode_id"] == ep for r in rows), reason, detail,
                 sum(trainable_tokens(r) for r in rows if r["episode_id"] == ep))
                for ep, (reason, detail) in reasons.items()]
    return replace(group, rows=kept), excluded


@dataclass
class RolloutStats:
    groups: int = 0
    rows_padded: int = 0
    groups_deferred: int = 0  # put back for the next generation batch (did not fit in this one's rest)
    groups_multi_block: int = 0  # laid out over more than one block of G rows
    rows_masked_truncated: int = 0  # env_mask zeroed: episode ended by length/timeout
    skipped: Counter = field(default_factory=Counter)
    rows_skipped: int = 0  # rows of skipped groups
    # whole episodes excluded, rows by reason: sampling the trainer cannot reproduce, too_long
    rows_excluded: Counter = field(default_factory=Counter)
    rows_null_version: int = 0  # rows whose weight_version is null (shard_source.py: the oldest version)
    groups_lag_unknown: int = 0  # groups whose lag has no place in any order (no sync history, no counter)
    # Per batch, reset by the trainer when it logs them.
    landing_latency: list[float] = field(default_factory=list)
    policy_lag: list[float] = field(default_factory=list)


def rows_to_columns(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in ROW_KEYS}


def shard_reward(prompts, completions, reward, **kwargs) -> list[float | None]:
    """The reward recorded in the shard (the episode's reward; None on padding rows)."""
    return list(reward)


class ShardRollout:
    """The ``rollout_func``: fills len(prompts) rows with whole groups from the source (module doc)."""

    def __init__(self, source: ShardSource, num_generations: int, policy: str = "pad",
                 wait_timeout: float | None = None, temperature: float | None = None,
                 served_default_temperature: float = 1.0, is_correction: bool = False,
                 max_length: int | None = None, mask_truncated: bool = False,
                 max_realign_share: float | None = None, ledger: ExclusionLedger | None = None):
        self.source = source
        self.g = num_generations
        self.policy = policy
        self.wait_timeout = wait_timeout
        self.temperature = temperature  # the trainer's; None: not checked
        self.served_default_temperature = served_default_temperature
        self.is_correction = is_correction  # resolve each row's sampling transform (or exclude the episode)
        self.max_realign_share = max_realign_share  # rows re-rendered beyond this share: episode excluded
        self.ledger = ledger or ExclusionLedger(None, 1)  # excluded share (row_exclusions.py)
        self.max_length = max_length  # rows longer: episode excluded (too_long)
        self.mask_truncated = mask_truncated  # the trainer's mask_truncated_completions
        self.stats = RolloutStats()
        self.batch_transforms: list[Transform | None] = []  # of the last call's rows, in order
        self.batch_realign: list[int] = []  # realign_tokens of the last call's rows, in order

    def __call__(self, prompts: list, trainer=None) -> dict[str, list]:
        if len(prompts) % self.g:
            raise ValueError(f"{len(prompts)} prompts is not a multiple of num_generations {self.g}")
        world = self.source.world_size
        rows = self._fill(len(prompts), trainer) if world == 1 else self._fill_in_lockstep(len(prompts), trainer)
        if self.mask_truncated:
            eos = set(getattr(trainer, "eos_token_ids", None) or [])
            tok = getattr(trainer, "_tokenizer", None)
            if tok is not None and tok.pad_token_id is not None:
                eos.add(tok.pad_token_id)
            self.stats.rows_masked_truncated += mask_truncated(rows, eos)
        self.batch_transforms = [r["transform"] for r in rows]
        self.batch_realign = [0 if r["polar_pad"] else r["realign_tokens"] for r in rows]
        return rows_to_columns(rows)

    def _fill(self, n: int, trainer, timeout: float | None = None, block: bool = True) -> list[dict]:
        """Rows for this rank: whole groups, then padding blocks when the next group does not fit.
        ``block`` False: stop (returning what it has) when no group is available right now."""
        rows = getattr(self, "_partial", None) or []
        self._partial = None
        while len(rows) < n:
            if block:
                try:
                    group = self.source.next_group(self.wait_timeout if timeout is None else timeout)
                except NoShardsError as exc:
                    raise self.explain(exc) from None
            else:
                group = self.source.try_next()
                if group is None:
                    self._partial = rows
                    return rows
            fitted = self._prepare(group)
            if fitted is None:
                continue
            if len(fitted) > n:
                raise GroupTooLarge(
                    f"group {group.group_id} of {group.shard} needs {len(fitted)} rows ({len(group.episodes)} "
                    f"episodes, {len(group.rows)} segments) but a generation batch holds {n} per rank: raise "
                    "per_device_train_batch_size x steps_per_generation (or num_generations) so a whole group "
                    "fits; its episodes share one baseline and cannot be split across batches")
            if len(fitted) > n - len(rows):
                self.source.push_back(group)  # first in the next batch; the cursor stays before it
                self.stats.groups_deferred += 1
                log.info("group %s of %s (%d rows) does not fit in the %d rows left of this batch: next batch",
                         group.group_id, group.shard, len(fitted), n - len(rows))
                pads = [pad_row(rows[0] if rows else fitted[0]) for _ in range(n - len(rows))]
                self.stats.rows_padded += len(pads)
                rows += pads
                break
            self._account(group, fitted)
            rows += fitted
        if not block:
            self._partial = rows  # kept until every rank is done (lockstep); the caller clears it
        return rows

    def _fill_in_lockstep(self, n: int, trainer) -> list[dict]:
        """Several ranks: each fills from its own partition without blocking; every poll interval all
        ranks exchange whether they are done and whether one ran past the wait timeout. They finish
        together, and when any rank runs out (timeout) every rank raises NoShardsError together: no
        rank is left alone in a collective while another waits for data. With no timeout, all ranks
        wait together for as long as data takes (a stream)."""

        t0 = time.monotonic()
        while True:
            error = None
            try:
                rows = self._fill(n, trainer, block=False)
            except Exception as e:  # noqa: BLE001 - re-raised below, after telling the other ranks
                error, rows = e, []
            timed_out = self.wait_timeout is not None and time.monotonic() - t0 >= self.wait_timeout
            mine = torch.tensor([[len(rows) >= n, timed_out and len(rows) < n, error is not None]],
                                dtype=torch.long, device=trainer.accelerator.device)
            flags = trainer.accelerator.gather(mine).view(-1, 3).cpu()
            if bool(flags[:, 2].any()):  # a rank failed (bad shard, refused sampling, ...): all stop
                if error is not None:
                    raise error
                bad = [r for r in range(flags.size(0)) if flags[r, 2]]
                raise RuntimeError(f"rank(s) {bad} failed while reading their shard groups (their log says why); "
                                   "every rank stops here")
            if bool(flags[:, 0].all()):
                self._partial = None
                self.source.stats.wait_seconds += time.monotonic() - t0
                return rows
            if bool(flags[:, 1].any()):
                short = [r for r in range(flags.size(0)) if flags[r, 1]]
                raise self.explain(NoShardsError(
                    f"rank(s) {short} of {flags.size(0)} got no group of their partition in "
                    f"{self.wait_timeout}s (this rank {self.source.rank}: {len(rows)}/{n} rows, cursor "
                    f"{self.source.cursor}); every rank stops here"))
            time.sleep(self.source.poll_interval)

    def explain(self, exc: NoShardsError) -> NoShardsError:
        """The wait's error, with why the groups read so far did not train (excluded episodes by
        reason, with each reason's fix; skipped groups): "no complete group" alone says nothing
        when every group was read and excluded, e.g. rows whose sampling the proxy could not learn."""
        ex, skipped = self.stats.rows_excluded, self.stats.skipped
        if not ex and not skipped:
            return exc
        text = f"{exc}. Groups were read but did not train"
        if skipped:
            text += f": groups skipped {dict(skipped)} (fewer than 2 episodes left, or not of the group size)"
        if ex:
            text += ". Rows excluded (their episodes with them): " + explain_excluded(ex, self.ledger.details)
        return NoShardsError(text)

    def _resolve(self, row: dict, where: str):
        return resolve_row(row, trainer_temperature=self.temperature,
                           served_default_temperature=self.served_default_temperature,
                           is_correction=self.is_correction, max_realign_share=self.max_realign_share, where=where)

    def _prepare(self, group) -> list[dict] | None:
        """The group's rows for TRL (exclusions applied, laid out in blocks), or None if skipped.
        Raises ExcludedShareError (row_exclusions.py) when the excluded share passes the threshold."""
        tokens = sum(trainable_tokens(r) for r in group.rows)
        group, excluded = resolve_sampling(group, self._resolve)
        group, too_long = exclude_too_long(group, self.max_length)
        ex_tokens, ex_rows, details = Counter(), Counter(), {}
        for ep, k, reason, detail, n in excluded:
            self.stats.rows_excluded[reason] += k
            ex_tokens[reason] += n
            ex_rows[reason] += k
            details[reason] = detail
            log.warning("group %s of %s: excluding episode %s (%d rows, %d trainable tokens) from training: %s: %s",
                        group.group_id, group.shard, ep, k, n, reason, detail)
        for ep, k, why in too_long:
            self.stats.rows_excluded["too_long"] += k
            log.warning("group %s of %s: excluding episode %s (%d rows) from training: %s",
                        group.group_id, group.shard, ep, k, why)
        self.ledger.add(tokens, ex_tokens, ex_rows, details)
        self.ledger.check(f"group {group.group_id} of {group.shard}: ")
        fitted, note = fit_group(group, self.g, self.policy) if group.rows else (None, "no episode left")
        if fitted is None:
            self.stats.skipped["size_mismatch" if self.policy == "skip" else "too_few_episodes"] += 1
            self.stats.rows_skipped += len(group.rows)
            log.warning("skipping group %s of %s: %s", group.group_id, group.shard, note)
            return None
        if note:
            log.info("group %s of %s: %s", group.group_id, group.shard, note)
        return fitted

    def _account(self, group, fitted: list[dict]) -> None:
        n_real = sum(not r["polar_pad"] for r in fitted)
        self.stats.rows_padded += len(fitted) - n_real
        self.stats.groups_multi_block += len(fitted) > self.g
        self.stats.groups += 1
        self.stats.landing_latency.append(time.time() - group.landed_at)
        lag = self.source.lag_of(group)  # (shard_source.py: syncs behind, by the sync history)
        self.stats.rows_null_version += sum(r.get("weight_version") is None for r in group.rows)
        if lag is not None:
            self.stats.policy_lag.append(lag)
        else:
            self.stats.groups_lag_unknown += 1
