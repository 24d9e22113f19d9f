"""Shard files and the build manifest (the I/O edge of reconstruction).

The file names are the contract in polar_contracts/shards.py. A shard is written to its temporary name one row
group at a time and renamed only when complete, so a reader never sees a partial shard. The
manifest (also written by rename) records the strategy and every
episode already built; a crash between a shard's rename and the manifest's save is repaired on the
next start by reading the ``episode_id`` column of shards the manifest does not know yet.
"""
from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from polar_contracts.sampling_fields import COLUMNS as SAMPLING_COLUMNS
from polar_contracts.shards import (
    FIDELITY_COLUMNS,
    LOCK,
    MANIFEST,
    SHARD_RE,
    SHARD_SCHEMA,
    SHARD_TEMP_GLOB,
    shard_name,
    shard_temp_name,
    temp_name,
)
from polar_recon import verdicts as verdicts_
from polar_recon.ledger import Ledger
from polar_recon.strategies import Sequence


class ManifestError(Exception):
    pass


def _list_array(arrays: list[np.ndarray], dtype) -> pa.Array:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values)).cast(pa.list_(pa.from_numpy_dtype(dtype)))


@dataclass
class GroupRows:
    """The sequences of one GRPO group, ready to write."""
    group_id: str
    episodes: list[tuple[str, float, list[Sequence]]]  # (episode_id, reward, sequences)
    strategy: str
    complete: bool = True
    # sampled completions of these episodes trained in no row: (episode, call_index, choice, reason)
    excluded: list[tuple[str, int, int, str]] = field(default_factory=list)
    evals: dict[str, str] = field(default_factory=dict)  # episode_id -> the "eval" column (JSON)
    ledgers: dict[str, Ledger] = field(default_factory=dict)  # episode_id -> its coverage ledger

    def table(self) -> pa.Table:
        seqs = [(eid, r, s) for eid, r, ss in self.episodes for s in ss]
        n = len(seqs)
        cols = {
            "episode_id": pa.array([e for e, _, _ in seqs], pa.string()),
            "group_id": pa.array([self.group_id] * n, pa.string()),
            "segment": pa.array([s.segment for _, _, s in seqs], pa.int32()),
            "input_ids": _list_array([s.input_ids for _, _, s in seqs], np.int32),
            "loss_mask": _list_array([s.loss_mask for _, _, s in seqs], np.int8),
            "logprobs": _list_array([s.logprobs for _, _, s in seqs], np.float32),
            "prompt_len": pa.array([s.prompt_len for _, _, s in seqs], pa.int32()),
            "reward": pa.array([r for _, r, _ in seqs], pa.float64()),
            "n_calls": pa.array([s.n_calls for _, _, s in seqs], pa.int32()),
            "strategy": pa.array([self.strategy] * n, pa.string()),
            "n_realign": pa.array([s.n_realign for _, _, s in seqs], pa.int32()),
            "weight_version": pa.array([s.weight_version for _, _, s in seqs], pa.string()),
            "model": pa.array([s.model for _, _, s in seqs], pa.string()),
            "group_size": pa.array([len(self.episodes)] * n, pa.int32()),
            "group_complete": pa.array([self.complete] * n, pa.bool_()),
        }
        for f in SAMPLING_COLUMNS:
            cols[f] = pa.array([getattr(s, f) for _, _, s in seqs], SHARD_SCHEMA.field(f).type)
        for f in FIDELITY_COLUMNS:
            cols[f] = pa.array([getattr(s, f) for _, _, s in seqs], SHARD_SCHEMA.field(f).type)
        cols["eval"] = pa.array([self.evals.get(e) for e, _, _ in seqs], pa.string())
        return pa.Table.from_pydict(cols, schema=SHARD_SCHEMA)


class ShardWriter:
    """Writes one shard under a temporary name; `commit` renames it into place."""

    def __init__(self, out: Path, number: int, compression: str = "zstd"):
        self.out, self.number = out, number
        self.path = out / shard_name(number)
        self.tmp = out / shard_temp_name(number)
        # Dictionary encoding and statistics only pay off on the small string columns; on token
        # lists they cost more time than the whole reconstruction.
        self._writer = pq.ParquetWriter(
            str(self.tmp), SHARD_SCHEMA, compression=compression,
            use_dictionary=["episode_id", "group_id", "strategy", "weight_version", "model", "logprobs_mode",
                            "sampling_unsupported", "termination", "isolation", "control_plane"],
            write_statistics=["episode_id", "group_id", "segment", "reward", "group_complete"])
        self.rows = 0
        self.episodes: dict[str, str] = {}  # episode_id -> group_id
        self.excluded: list[tuple[str, int, int, str]] = []
        self.ledgers: dict[str, Ledger] = {}

    def write(self, group: GroupRows) -> None:
        t = group.table()
        if t.num_rows:
            self._writer.write_table(t)
        self.rows += t.num_rows
        for eid, _, _ in group.episodes:
            self.episodes[eid] = group.group_id
        self.excluded += group.excluded
        self.ledgers.update(group.ledgers)

    def commit(self) -> Path:
        self._writer.close()
        _fsync_file(self.tmp)
        os.replace(self.tmp, self.path)
        _fsync_dir(self.out)
        return self.path

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems refuse fsync on directories; the rename is still atomic
        pass


@dataclass
class Manifest:
    out: Path
    strategy: str
    next_shard: int = 0
    episodes: dict[str, dict] = field(default_factory=dict)  # episode_id -> {"shard": n, "group": g}
    # episodes seen and deliberately not built (e.g. discarded by the rollout): episode_id ->
    # {"reason": ..., "status": ...}; for `stats`, and so the count survives across builds
    excluded: dict[str, dict] = field(default_factory=dict)
    # sampled completions of BUILT episodes that train in no row (fidelity.EXCLUDE_REASONS):
    # episode_id -> [{"call", "choice", "reason"}]; saved with `excluded_counts` {reason: n}
    excluded_calls: dict[str, list] = field(default_factory=dict)
    # how every finished episode (built or discarded) was graded, with its policy version
    # (verdicts.py): episode_id -> {policy, verdict, tampered, discarded, status}; saved with
    # `verdict_counts` {policy: {episodes, discarded, eval_error, tampered, ..., rates}}
    verdicts: dict[str, dict] = field(default_factory=dict)
    # the coverage ledger (polar_recon/ledger.py) of every built episode: episode_id ->
    # {"sampled", "trained", "excluded": {reason: tokens}, "calls"}; saved with `ledger_total` (their
    # sum, with the number of built episodes that have none: manifests written before the ledger)
    ledger: dict[str, dict] = field(default_factory=dict)
    _dirty: bool = False

    @classmethod
    def open(cls, out: str | os.PathLike, strategy: str) -> Manifest:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / MANIFEST
        m = cls(out, strategy)
        m._lock()
        if path.exists():
            try:
                data = json.loads(path.read_text())
                m.next_shard, m.episodes = int(data["next_shard"]), dict(data["episodes"])
                m.excluded = dict(data.get("excluded") or {})
                m.excluded_calls = dict(data.get("excluded_calls") or {})
                m.verdicts = dict(data.get("verdicts") or {})
                m.ledger = dict(data.get("ledger") or {})
                built_with = data["strategy"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ManifestError(f"{path}: unreadable manifest ({exc}); move it away to rebuild") from exc
            if built_with != strategy:
                raise ManifestError(f"{out} holds shards built with strategy {built_with!r}, not {strategy!r}: use another OUT")
        m._adopt_unrecorded_shards()
        for stale in out.glob(SHARD_TEMP_GLOB):  # a build killed mid-shard: never visible, drop it
            stale.unlink(missing_ok=True)
        return m

    def _lock(self) -> None:
        """One builder per OUT (shard numbers and the manifest are not shared): an advisory lock
        held for the life of this process's manifest."""

        self._lock_file = open(self.out / LOCK, "w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise ManifestError(f"{self.out}: another polar-recon build/watch is writing here") from None

    def close(self) -> None:
        if getattr(self, "_lock_file", None) is not None:
            self._lock_file.close()
            self._lock_file = None

    def _adopt_unrecorded_shards(self) -> None:
        for p in sorted(self.out.iterdir()):
            mt = SHARD_RE.match(p.name)
            if not mt or int(mt.group(1)) < self.next_shard:
                continue
            n = int(mt.group(1))
            t = pq.read_table(p, columns=["episode_id", "group_id"])
            for eid, gid in zip(t.column("episode_id").to_pylist(), t.column("group_id").to_pylist()):
                self.episodes[eid] = {"shard": n, "group": gid}
            self.next_shard = max(self.next_shard, n + 1)
        if self.next_shard:
            self.save()

    def record(self, writer: ShardWriter) -> None:
        for eid, gid in writer.episodes.items():
            self.episodes[eid] = {"shard": writer.number, "group": gid}
        for eid, call, choice, reason in writer.excluded:
            self.excluded_calls.setdefault(eid, []).append({"call": call, "choice": choice, "reason": reason})
        for eid, led in writer.ledgers.items():
            self.ledger[eid] = led.to_json()
        self.next_shard = max(self.next_shard, writer.number + 1)
        self.save()

    def exclude(self, episode_id: str, reason: str, status=None) -> None:
        entry = {"reason": reason, "status": status}
        if self.excluded.get(episode_id) != entry:
            self.excluded[episode_id] = entry
            self._dirty = True

    def note_verdict(self, episode_id: str, metadata: dict, policy: str | None) -> None:
        entry = verdicts_.entry(metadata, policy)
        if self.verdicts.get(episode_id) != entry:
            self.verdicts[episode_id] = entry
            self._dirty = True

    def save_if_changed(self) -> None:
        if self._dirty:
            self.save()

    def excluded_counts(self) -> dict[str, int]:
        """Excluded episodes (by their reason) and excluded calls of built episodes (by theirs)."""
        out: dict[str, int] = {}
        for v in self.excluded.values():
            r = f"episode: {v.get('reason')}" if isinstance(v, dict) else "episode"
            out[r] = out.get(r, 0) + 1
        for calls in self.excluded_calls.values():
            for c in calls:
                out[c["reason"]] = out.get(c["reason"], 0) + 1
        return out

    def ledger_total(self) -> dict:
        """The sum of the built episodes' ledgers; `episodes_without_ledger` counts the built
        episodes a manifest from before the ledger has none for (not in the sum)."""
        total = Ledger()
        for eid, d in self.ledger.items():
            total.add(Ledger.from_json(d, f"{self.out / MANIFEST}: ledger of {eid}"))
        out = total.to_json()
        out["episodes_without_ledger"] = sum(1 for e in self.episodes if e not in self.ledger)
        return out

    def save(self) -> None:
        path = self.out / MANIFEST
        tmp = self.out / temp_name(MANIFEST)
        tmp.write_text(json.dumps({"version": 1, "strategy": self.strategy, "next_shard": self.next_shard,
                                   "episodes": self.episodes, "excluded": self.excluded,
                                   "excluded_calls": self.excluded_calls,
                                   "excluded_counts": self.excluded_counts(), "verdicts": self.verdicts,
                                   "verdict_counts": verdicts_.counts(self.verdicts),
                                   "ledger": self.ledger, "ledger_total": self.ledger_total()}, sort_keys=True))
        os.replace(tmp, path)
        self._dirty = False

    def new_shard(self) -> ShardWriter:
        w = ShardWriter(self.out, self.next_shard)
        self.next_shard += 1
        return w


def list_shards(out: str | os.PathLike) -> list[Path]:
    return sorted(p for p in Path(out).iterdir() if SHARD_RE.match(p.name))
