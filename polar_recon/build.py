"""`build` and `watch`: finished episode logs -> shards of complete GRPO groups.

Memory: the first pass reads only each log's end record (reward, metadata) to form groups; the
second pass reads one episode at a time and keeps only its sequences until its group is written.
Nothing here holds more than one episode's calls, or one group's sequences.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_contracts.log import end_record as end
from polar_contracts.log.arrays import list_logs, read_calls
from polar_contracts.log.end_record import EpisodeHead, GroupKeyError, read_head
from polar_contracts.log.table import LogError
from polar_recon.shard_writer import GroupRows, Manifest, ShardWriter

from .fidelity import check_sequences
from .ledger import Ledger, episode_ledger
from .link import link_calls
from .strategies import (
    STRATEGIES,
    ReconError,
    Retokenizer,
    oldest_version,
    per_call_sequences,
    retokenize_sequences,
    token_sequences,
    unlinked_exclusions,
)
from .tokens import DEFAULT_TOKENIZER, TurnMarkers
from .verdicts import log_policy


class RewardsError(ValueError):
    pass


def load_rewards(path: str | os.PathLike) -> dict[str, float]:
    """JSON object {episode_id: reward}, a JSON list of {"episode_id", "reward"}, or JSONL of those."""
    p = Path(path)
    text = p.read_text()
    try:
        data = json.loads(text)
        rows = list(data.items()) if isinstance(data, dict) else [(r["episode_id"], r["reward"]) for r in data]
    except json.JSONDecodeError:
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                rows.append((r["episode_id"], r["reward"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise RewardsError(f"{p}:{n}: expected {{\"episode_id\": ..., \"reward\": ...}} ({exc})") from exc
    except (KeyError, TypeError) as exc:
        raise RewardsError(f"{p}: expected {{episode_id: reward}} or a list of {{episode_id, reward}} ({exc})") from exc
    out = {}
    for eid, r in rows:
        if isinstance(r, bool) or not isinstance(r, (int, float)) or r != r:
            raise RewardsError(f"{p}: reward of episode {eid!r} is not a number: {r!r}")
        out[str(eid)] = float(r)
    return out


@dataclass
class Options:
    strategy: str = "token"
    rewards: dict[str, float] | None = None
    group_by: str | None = None  # metadata key; None: end_record.GROUP_ID if present, else the episode
    shard_size: int = 256  # rows per shard, at least (groups are never split)
    group_size: int | None = None  # episodes per complete group, when known
    include_incomplete: bool = False  # build: write groups short of group_size, flagged
    tokenizer: str | os.PathLike = DEFAULT_TOKENIZER
    # rows longer than this are split at a call boundary (each part re-checked) or, for one call
    # alone longer, left out with the reason "longer than max_len"; never truncated. None: no limit.
    max_len: int | None = None
    exclude_rejected_retries: bool = False  # RETRY siblings left out (counted) instead of own segments
    check: bool = False  # re-verify every episode's rows (fidelity.check_sequences); a failure is an error

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}: one of {', '.join(STRATEGIES)}")
        if self.shard_size < 1:
            raise ValueError("shard size must be >= 1")
        if self.max_len is not None and self.max_len < 2:
            raise ValueError(f"max_len must be >= 2 tokens, got {self.max_len}")


def model_max_len(model_dir: str | os.PathLike) -> int:
    """max_position_embeddings of a model directory's config.json (the default --max-len)."""
    path = Path(model_dir) / "config.json"
    try:
        n = json.loads(path.read_text())["max_position_embeddings"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: no max_position_embeddings ({exc})") from exc
    if not isinstance(n, int) or n < 2:
        raise ValueError(f"{path}: max_position_embeddings is not a length: {n!r}")
    return n


@dataclass
class Report:
    built: list[str] = field(default_factory=list)
    already: int = 0
    unfinished: list[str] = field(default_factory=list)
    no_reward: list[str] = field(default_factory=list)
    # ended by the rollout with metadata.discard = true (Ctrl-C, infrastructure failure): no signal
    discarded: list[str] = field(default_factory=list)
    errors: list[tuple[str, str]] = field(default_factory=list)  # (file or episode, message)
    waiting: dict[str, int] = field(default_factory=dict)  # incomplete group -> episodes finished
    shards: list[Path] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    trainable: int = 0
    timed_out_groups: list[str] = field(default_factory=list)
    # sampled completions of built episodes that train in no row: (episode, call_index, choice, reason)
    excluded_calls: list[tuple[str, int, int, str]] = field(default_factory=list)
    # the coverage ledger (ledger.py) of the episodes built by this run, and its total
    ledgers: dict[str, Ledger] = field(default_factory=dict)
    ledger: Ledger = field(default_factory=Ledger)

    def excluded_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for *_, reason in self.excluded_calls:
            out[reason] = out.get(reason, 0) + 1
        return out


def is_discarded(head: EpisodeHead) -> bool:
    """The rollout node cut the episode short itself (harness_recipes: status error/interrupted)
    and said so in the end record: its calls are no training signal, whatever its reward."""
    return end.is_discarded(head.metadata)


def group_of(head: EpisodeHead, group_by: str | None) -> str:
    """The end record's group (polar_contracts/log/end_record.py group_of), as a ReconError
    naming the file when --group-by names a key the record lacks."""
    try:
        return end.group_of(head.metadata, head.episode_id, group_by)
    except GroupKeyError as exc:
        raise ReconError(f"{head.path}: {exc}") from None


class Builder:
    """Turns episodes into sequences with one strategy (tokenizer state loaded once)."""

    def __init__(self, opts: Options):
        self.opts = opts
        self.markers = TurnMarkers.load(str(opts.tokenizer))
        self.retok = Retokenizer(opts.tokenizer) if opts.strategy == "retokenize" else None
        self.excluded: list[tuple[str, int, int, str]] = []
        self.ledger: Ledger | None = None

    def sequences(self, path: Path):
        """The episode's rows; `self.excluded` then holds (episode, call_index, choice, reason) of
        every sampled completion that trains in none of them, and `self.ledger` its coverage ledger
        (a LedgerError, a ReconError, when the two do not account for every sampled token)."""
        self.excluded: list[tuple[str, int, int, str]] = []
        self.ledger = None
        ep = read_calls(path, with_requests=self.retok is not None)
        rows: list[tuple[int, str]] = []  # (call row, reason)
        o = self.opts
        if o.strategy == "token":
            seqs = token_sequences(ep, self.markers, max_len=o.max_len, exclude_retries=o.exclude_rejected_retries,
                                   excluded=rows)
        elif o.strategy == "per-call":
            seqs = per_call_sequences(ep, max_len=o.max_len, excluded=rows)
        else:
            nodes = link_calls(ep.calls, self.markers)
            seqs = retokenize_sequences(ep, self.markers, self.retok, nodes)
            rows += unlinked_exclusions(nodes)  # the calls linking left out, as the token strategy lists them
        # a sequence with nothing to train (an empty completion) carries no signal and breaks the
        # contract that prompt_len indexes a trainable token
        empty = [s for s in seqs if not s.loss_mask.any()]
        seqs = [s for s in seqs if s.loss_mask.any()]
        rows += [(r, "empty completion") for s in empty for r in s.call_rows]
        if o.check and o.strategy != "retokenize":
            problems = check_sequences(ep, seqs, rows, self.markers)
            if problems:
                raise ReconError(f"{path}: fidelity check failed: " + "; ".join(problems[:5]))
        # before the episode's rows go anywhere: every sampled token trained once or excluded once
        self.ledger = episode_ledger(ep, seqs, rows, mask_counts=o.strategy != "retokenize")
        by_row = {c.row: c for c in ep.calls}
        self.excluded = [(ep.episode_id, by_row[r].call_index, int(by_row[r].info.get("choice") or 0), reason)
                         for r, reason in rows]
        return seqs


def _classify(heads: Iterable[tuple[Path, EpisodeHead | LogError]], manifest: Manifest, opts: Options,
              report: Report) -> dict[str, list[tuple[EpisodeHead, float]]]:
    groups: dict[str, list[tuple[EpisodeHead, float]]] = {}
    for path, head in heads:
        if isinstance(head, LogError):
            report.errors.append((str(path), str(head)))
            continue
        if not head.finished:
            report.unfinished.append(head.episode_id)
            continue
        if is_discarded(head):
            report.discarded.append(head.episode_id)
            manifest.exclude(head.episode_id, "discard", head.metadata.get(end.STATUS))
            if head.episode_id not in manifest.verdicts:  # (watch sees it every cycle: read its log once)
                manifest.note_verdict(head.episode_id, head.metadata, log_policy(head.path))
            continue
        reward = (opts.rewards or {}).get(head.episode_id, head.reward)
        if reward is None:
            report.no_reward.append(head.episode_id)
            continue
        try:
            g = group_of(head, opts.group_by)
        except ReconError as exc:
            report.errors.append((str(path), str(exc)))
            continue
        groups.setdefault(g, []).append((head, float(reward)))
    return groups


def _heads(paths: list[Path], manifest: Manifest, report: Report):
    for p in paths:
        eid = p.name[: -len(".arrow")]
        if eid in manifest.episodes:
            report.already += 1
            continue
        try:
            yield p, read_head(p)
        except LogError as exc:
            yield p, exc


def _build_group(builder: Builder, gid: str, members: list[tuple[EpisodeHead, float]], complete: bool,
                 report: Report) -> GroupRows:
    rows = GroupRows(gid, [], builder.opts.strategy, complete)
    for head, reward in members:
        builder.excluded = []
        try:
            seqs = builder.sequences(head.path)
            excluded = builder.excluded
        except (LogError, ReconError) as exc:
            report.errors.append((str(head.path), f"episode {head.episode_id}: {exc}"))
            continue
        except OSError:
            raise  # the machine's trouble (disk, descriptors), not this episode's: stop, write nothing half
        except Exception as exc:  # noqa: BLE001 - a bug on one episode must not stop a whole run's watch
            # (the trainer would wait on shards forever); the episode is reported, never half-written
            traceback.print_exc()
            report.errors.append((str(head.path), f"episode {head.episode_id}: internal error (a bug in "
                                                   f"polar-recon, please report it): {type(exc).__name__}: {exc}"))
            continue
        if not seqs:
            report.excluded_calls += excluded
            why = ", ".join(sorted({r for *_, r in excluded})) or "no calls"
            report.errors.append((str(head.path), f"episode {head.episode_id}: no usable call ({why})"))
            continue
        rows.episodes.append((head.episode_id, reward, seqs))
        if isinstance(head.metadata.get(end.EVAL), dict):
            rows.evals[head.episode_id] = json.dumps(head.metadata[end.EVAL], sort_keys=True)
        rows.excluded += excluded
        rows.ledgers[head.episode_id] = builder.ledger
        report.ledgers[head.episode_id] = builder.ledger
        report.ledger.add(builder.ledger)
        report.excluded_calls += excluded
        report.built.append(head.episode_id)
        report.sequences += len(seqs)
        for s in seqs:
            report.tokens += len(s.input_ids)
            report.trainable += int(s.loss_mask.sum())
    return rows


def _write_groups(builder: Builder, manifest: Manifest, ready: list[tuple[str, list, bool]], report: Report,
                  progress: Callable[[int], None] | None = None) -> None:
    writer: ShardWriter | None = None
    try:
        for gid, members, complete in ready:
            rows = _build_group(builder, gid, members, complete, report)
            if progress:
                progress(len(members))
            heads = {h.episode_id: h for h, _ in members}
            for eid, _, seqs in rows.episodes:  # saved with the shard's record below
                manifest.note_verdict(eid, heads[eid].metadata, oldest_version([s.weight_version for s in seqs]))
            if not rows.episodes:
                continue
            if writer is None:
                writer = manifest.new_shard()
            writer.write(rows)
            if not complete:
                report.timed_out_groups.append(gid)
            if writer.rows >= builder.opts.shard_size:
                report.shards.append(writer.commit())
                manifest.record(writer)
                writer = None
        if writer is not None:
            report.shards.append(writer.commit())
            manifest.record(writer)
            writer = None
    finally:
        if writer is not None:
            writer.abort()


def _ready_groups(groups, opts: Options, report: Report) -> list[tuple[str, list, bool]]:
    ready = []
    for gid, members in groups.items():
        complete = opts.group_size is None or len(members) >= opts.group_size
        if not complete and not opts.include_incomplete:
            report.waiting[gid] = len(members)
            continue
        ready.append((gid, members, complete))
    # landing order: a group lands when its last episode finished
    ready.sort(key=lambda g: max(h.mtime for h, _ in g[1]))
    return ready


def _counted(items, bar):
    for x in items:
        bar.update(1)
        yield x
    bar.close()


def build(logdir: str | os.PathLike, out: str | os.PathLike, opts: Options,
          progress_factory: Callable[[int, str], Any] | None = None) -> Report:
    report = Report()
    manifest = Manifest.open(out, opts.strategy)
    try:
        _build(logdir, manifest, Builder(opts), opts, report, progress_factory)
    finally:
        manifest.close()
    return report


def _build(logdir, manifest: Manifest, builder: Builder, opts: Options, report: Report, progress_factory) -> None:
    paths = list_logs(logdir)
    heads = _heads(paths, manifest, report)
    if progress_factory:
        heads = _counted(heads, progress_factory(len(paths), "reading end records"))
    groups = _classify(heads, manifest, opts, report)
    ready = _ready_groups(groups, opts, report)
    n = sum(len(m) for _, m, _ in ready)
    bar = progress_factory(n, "building") if progress_factory else None
    _write_groups(builder, manifest, ready, report, (lambda k: bar.update(k)) if bar else None)
    if bar:
        bar.close()
    manifest.save_if_changed()


def watch(logdir: str | os.PathLike, out: str | os.PathLike, opts: Options, *, poll: float = 2.0,
          group_timeout: float | None = None, idle_exit: float | None = None,
          on_report: Callable[[Report], None] | None = None, should_stop: Callable[[], bool] = lambda: False) -> Report:
    """Build continuously. A group is written once `group_size` of its episodes have finished (or,
    without a group size, as soon as it is seen), or when `group_timeout` seconds passed since its
    first episode finished, flagged group_complete=false. Returns the merged report on exit."""
    manifest = Manifest.open(out, opts.strategy)
    try:
        return _watch(logdir, manifest, Builder(opts), opts, poll, group_timeout, idle_exit, on_report, should_stop)
    finally:
        manifest.close()


def _watch(logdir, manifest: Manifest, builder: Builder, opts: Options, poll, group_timeout, idle_exit, on_report,
           should_stop) -> Report:
    total = Report()
    pending: dict[str, list[tuple[EpisodeHead, float]]] = {}
    first_seen: dict[str, float] = {}
    reported: set[str] = set()
    skip: dict[str, float] = {}  # log name -> mtime at which it failed or had no reward
    last_activity = time.monotonic()
    while not should_stop():
        cycle = Report()
        known = {h.episode_id for ms in pending.values() for h, _ in ms}
        paths = [p for p in list_logs(logdir)
                 if p.name[: -len(".arrow")] not in known and skip.get(p.name) != _mtime(p)]
        groups = _classify(_heads(paths, manifest, cycle), manifest, opts, cycle)
        now = time.monotonic()
        for gid, members in groups.items():
            pending.setdefault(gid, []).extend(members)
            first_seen.setdefault(gid, now)
        ready = []
        for gid in list(pending):
            members = pending[gid]
            complete = opts.group_size is None or len(members) >= opts.group_size
            timed_out = group_timeout is not None and now - first_seen[gid] >= group_timeout
            if complete or timed_out:
                ready.append((gid, pending.pop(gid), complete))
                first_seen.pop(gid)
        if ready:
            _write_groups(builder, manifest, ready, cycle)
            last_activity = time.monotonic()
        for p, _ in cycle.errors:
            skip[Path(p).name] = _mtime(Path(p))
        for eid in cycle.no_reward + cycle.discarded:
            skip[eid + ".arrow"] = _mtime(Path(logdir) / (eid + ".arrow"))
        manifest.save_if_changed()
        _merge(total, cycle, reported)
        if on_report and (ready or cycle.errors or cycle.no_reward or cycle.discarded):
            on_report(cycle)
        if idle_exit is not None and time.monotonic() - last_activity >= idle_exit and not pending:
            break
        time.sleep(poll)
    return total


def _mtime(p: Path) -> float:
    try:
        return p.stat().st_mtime
    except OSError:
        return -1.0


def _merge(total: Report, cycle: Report, reported: set[str]) -> None:
    total.built += cycle.built
    total.shards += cycle.shards
    total.sequences += cycle.sequences
    total.tokens += cycle.tokens
    total.trainable += cycle.trainable
    total.timed_out_groups += cycle.timed_out_groups
    total.excluded_calls += cycle.excluded_calls
    total.ledgers.update(cycle.ledgers)
    total.ledger.add(cycle.ledger)
    # a bad file is seen again every poll: report each one once
    cycle.errors = [(p, m) for p, m in cycle.errors if p not in reported]
    cycle.no_reward = [e for e in cycle.no_reward if e not in reported]
    cycle.discarded = [e for e in cycle.discarded if e not in reported]
    reported.update(p for p, _ in cycle.errors)
    reported.update(cycle.no_reward)
    reported.update(cycle.discarded)
    total.errors += cycle.errors
    total.no_reward += cycle.no_reward
    total.discarded += cycle.discarded
