"""Tail a shard directory for complete GRPO groups, in landing order, with a resumable cursor.

The shard contract (polar-recon writes, the trainer reads; names in polar_contracts/shards.py):
``OUT/shard-NNNNNN.parquet``, NNNNNN a zero-padded sequence number given in landing order, each file
written under a temporary name and renamed when complete, one row per training sequence (segment). Anything that does not match
``shard-<digits>.parquet`` exactly (``.shard-000001.parquet.tmp``, editor files) is ignored.

OUT may be a local directory or any filesystem URI: pyarrow's own (``file://``, ``s3://``,
``gs://``, ``hdfs://``) or, failing that, any fsspec protocol (``memory://``, ...) wrapped with
pyarrow's FSSpecHandler.

Order: each poll lists the directory and queues the shards it has not seen, by sequence number;
a shard discovered by a later poll comes after every shard found earlier. Within a shard, groups
come in the order their ``group_id`` first appears.

Cursor (what a checkpoint stores): the shards fully handed out, the shard being handed out and
how many of its groups were handed out. Handed out = returned by ``take``/``next_group`` or
dropped by a filter: the trainer pulls groups only when it starts a generation batch, so at a
checkpoint every handed-out group has been trained (see grpo_trainer.py for the save_steps check).
Restoring the cursor re-queues every other shard, so a restart neither repeats nor skips a group.

Weight versions are opaque strings (SGLang's and vLLM's ``"default"``, the trainer's
``step-000012``, polar-serve's reload counters). Their order is the sync history the source learns:
the weight-sync callback tells it the server's version when training starts (position 0) and each
new version a sync returns (``set_current_version``). The lag of a version is how many syncs it is
behind the newest: ``position(current) - position(version)``. Two versions outside the history
that are both decimal integers (polar-serve's reload counters, when nothing told the source the
history) compare as integers, and without any history the newest integer in the data is current.
A group's lag is the largest lag of its rows (each row carries the oldest version among its
calls). A null version is the oldest (``VersionOrder.lag``: the largest lag the order allows). With
``max_policy_lag`` set, a group is dropped when its lag exceeds it (``policy_lag``), when a row's
version is an ``unknown:`` marker or outside the order (``unknown_version``: its staleness cannot be
bounded), or when a row's call was in flight across a sync (``spans:`` marker,
polar_contracts/weight_versions.py: ``spans_versions``). Every drop is counted by reason and logged.
When nothing orders the versions (no sync history, no integer version in the data: a run that never
syncs) there is nothing to bound against and no group is dropped for its version (the rollout counts
them, ``groups_lag_unknown``). Every rank learns the same history (weight_sync.py broadcasts it).

Ranks (several training processes, e.g. ``accelerate launch``): TRL calls ``rollout_func`` on every
rank and every rank opens its own ShardSource on the same directory. ``rank``/``world_size`` partition
the groups: group ``k`` of shard ``shard-N`` (k = its position among the shard's groups) belongs to rank
``(N + k) % world_size``. The owner depends only on the shard's sequence number and the group's place
in it, never on when a rank listed the directory, so the ranks agree without talking, their groups
are disjoint and their union is every group; the other ranks' groups are stepped over (not counted as
drops). Each rank keeps its own cursor (its position in the same shard order) and saves it as
``polar_shard_cursor.rank<R>.json`` (one file per rank; ``polar_shard_cursor.json`` with one process);
a cursor records the world size it was made with and restoring it under another is refused (the
partition would move groups between ranks: some repeated, some skipped). What happens when one rank
runs out of groups before the others is the rollout's business (grpo_trainer.py ``ShardRollout``: the ranks
wait in lockstep and stop together).

Putting a group back (``push_back``): the rollout takes a group, finds it does not fit in what is left
of the generation batch, and returns it; the source hands it out again first, and until then its
cursor is the position before that group (a checkpoint never counts it as trained).
"""
from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from polar_contracts.shards import OPTIONAL_COLUMNS, TRAINING_COLUMNS, shard_seq
from polar_contracts.weight_versions import SPAN_PREFIX, UNKNOWN_PREFIX, is_proxy_version

log = logging.getLogger(__name__)

CURSOR_FILE = "polar_shard_cursor.json"


def cursor_file(rank: int = 0, world_size: int = 1) -> str:
    """The cursor's file name in a checkpoint: one per rank when there are several."""
    return CURSOR_FILE if world_size <= 1 else f"polar_shard_cursor.rank{rank}.json"


def group_owner(shard: str, index: int, world_size: int) -> int:
    """The rank that trains group ``index`` of ``shard`` (module doc: Ranks)."""
    seq = shard_seq(shard)
    if seq is None:
        raise ShardFormatError(f"{shard!r} is not a shard name")
    return (seq + index) % world_size



# every column of the contract but `eval` (per-test results for reports; large, never trained on)
_READ_COLUMNS = TRAINING_COLUMNS + tuple(c for c in OPTIONAL_COLUMNS if c != "eval")


class ShardFormatError(ValueError):
    """A shard that breaks the shard contract; the message names the shard, row and field."""


class NoShardsError(TimeoutError):
    """No complete group arrived within the wait timeout."""


def parse_version(v: Any) -> int | None:
    """A version that is a decimal integer (polar-serve's reload counter) as that integer, else None."""
    if v is None:
        return None
    s = str(v).strip()
    return int(s) if s.isdigit() else None


class VersionOrder:
    """The order of weight versions: the sync history (see the module doc)."""

    def __init__(self) -> None:
        self.history: list[str] = []
        self._position: dict[str, int] = {}
        self.newest_counter: int | None = None  # the newest integer version seen in the data

    def learn(self, version: str) -> None:
        """The server now serves ``version`` (the initial one, or what a sync returned)."""
        if self.history and self.history[-1] == version:
            return
        self._position.setdefault(version, len(self.history))
        self.history.append(version)

    def saw(self, version: str | None) -> None:
        n = parse_version(version)
        if n is not None and (self.newest_counter is None or n > self.newest_counter):
            self.newest_counter = n

    @property
    def current(self) -> str | None:
        if self.history:
            return self.history[-1]
        return None if self.newest_counter is None else str(self.newest_counter)

    @property
    def position(self) -> int | None:
        """The current version's place: its index in the history, or (no history) the newest counter."""
        return len(self.history) - 1 if self.history else self.newest_counter

    @property
    def empty(self) -> bool:
        """Nothing orders versions: no sync history and no integer version in the data."""
        return not self.history and self.newest_counter is None

    def lag(self, version: str | None) -> tuple[int | None, str]:
        """(syncs behind current, "") or (None, the drop category: unknown_version | spans_versions).

        A null version is the oldest one: stock vLLM and SGLang report none, and the proxy names a
        version only from the first sync through it, so a null row was generated before that sync (by the
        weights at position 0 of the history, or before the first counter). Taking the largest possible
        lag bounds its staleness from above: a null row after a sync (a server that never reports
        versions) is at worst dropped as too old, never trained as fresh."""
        if version is not None and version.startswith(UNKNOWN_PREFIX):
            return None, "unknown_version"
        if version is not None and version.startswith(SPAN_PREFIX):
            return None, "spans_versions"
        cur = self.current
        if cur is None:
            return None, "unknown_version"
        if version is None or (is_proxy_version(version) and version not in self._position):
            # the oldest: behind every synced version and every counter from 0. A proxy's own name
            # (its server names none) that the history never learned is the same case: the weights
            # before any sync this trainer knows of
            return max(len(self.history) - 1, parse_version(cur) or 0), ""
        if version in self._position and cur in self._position:
            return len(self.history) - 1 - self._position[version], ""
        a, b = parse_version(cur), parse_version(version)
        if a is not None and b is not None and version not in self._position:
            return a - b, ""
        return None, "unknown_version"


@dataclass
class ShardCursor:
    consumed: list[str] = field(default_factory=list)  # shards whose groups were all handed out
    current: str | None = None  # shard being handed out
    group_offset: int = 0  # groups of `current` handed out
    rank: int = 0
    world_size: int = 1  # the partition the cursor was made under (module doc: Ranks)

    def to_json(self) -> str:
        d = asdict(self)
        if self.world_size <= 1:  # one process: the file stays what it always was
            d.pop("rank"), d.pop("world_size")
        return json.dumps(d, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> ShardCursor:
        d = json.loads(text)
        if not isinstance(d, dict) or not isinstance(d.get("consumed"), list):
            raise ValueError(f"not a shard cursor: {text[:200]!r}")
        return cls(consumed=[str(x) for x in d["consumed"]], current=d.get("current"),
                   group_offset=int(d.get("group_offset", 0)), rank=int(d.get("rank", 0)),
                   world_size=int(d.get("world_size", 1)))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / cursor_file(self.rank, self.world_size)
        tmp = path.with_name("." + CURSOR_FILE + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, directory: str | Path, rank: int = 0, world_size: int = 1) -> ShardCursor:
        path = Path(directory) / cursor_file(rank, world_size)
        if not path.is_file():
            others = sorted(p.name for p in Path(directory).glob("polar_shard_cursor*.json"))
            raise FileNotFoundError(f"{path} not found: the checkpoint has no shard cursor for rank {rank} of "
                                    f"{world_size} (it has {others}; resume with the world size it was saved with)")
        c = cls.from_json(path.read_text())
        if (c.rank, c.world_size) != (rank, world_size):
            raise ValueError(f"{path} is the cursor of rank {c.rank} of {c.world_size}, not {rank} of {world_size}: "
                             "resume with the world size the checkpoint was saved with (the partition differs)")
        return c


@dataclass
class Group:
    """One GRPO group: every row (segment) of every episode of one task, as read from a shard."""
    group_id: str
    rows: list[dict]
    shard: str
    index: int  # position among the groups of its shard
    landed_at: float  # when the source first saw the shard (time.time())

    @property
    def versions(self) -> list[str | None]:
        """The distinct weight versions of the group's rows, in row order."""
        return list(dict.fromkeys(r.get("weight_version") for r in self.rows))

    @property
    def episodes(self) -> list[str]:
        return list(dict.fromkeys(r["episode_id"] for r in self.rows))

    @property
    def complete(self) -> bool:
        return all(r.get("group_complete", True) is not False for r in self.rows)


def check_row(row: dict, where: str) -> None:
    """The per-row invariants of the contract; a violation is a recon bug, so fail loudly."""
    n = len(row["input_ids"])
    for col in ("loss_mask", "logprobs"):
        if len(row[col]) != n:
            raise ShardFormatError(f"{where}: {col} has {len(row[col])} entries, input_ids has {n}")
    p = row["prompt_len"]
    if not (0 <= p < n):
        raise ShardFormatError(f"{where}: prompt_len {p} outside [0, {n}) (no trainable token?)")
    mask = row["loss_mask"]
    if mask[p] != 1 or any(mask[:p]):
        raise ShardFormatError(f"{where}: prompt_len {p} is not the index of the first loss_mask=1 token")
    if any(m not in (0, 1) for m in mask):
        raise ShardFormatError(f"{where}: loss_mask holds values other than 0/1")


def table_groups(table: pa.Table, shard: str, landed_at: float) -> list[Group]:
    """Split one shard's rows into groups, in order of first appearance of each group_id."""
    missing = [c for c in TRAINING_COLUMNS if c not in table.column_names]
    if missing:
        raise ShardFormatError(f"{shard}: missing columns {missing} (has {table.column_names})")
    cols = [c for c in _READ_COLUMNS if c in table.column_names]
    data = {c: table.column(c).to_pylist() for c in cols}
    groups: dict[str, list[dict]] = {}
    for i in range(table.num_rows):
        row = {c: data[c][i] for c in cols}
        if row["group_id"] is None or row["episode_id"] is None:
            raise ShardFormatError(f"{shard} row {i}: null group_id/episode_id")
        check_row(row, f"{shard} row {i} (episode {row['episode_id']})")
        groups.setdefault(row["group_id"], []).append(row)
    return [Group(gid, rows, shard, k, landed_at) for k, (gid, rows) in enumerate(groups.items())]


def resolve_filesystem(location: str, filesystem: pafs.FileSystem | None = None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path) for a local path, a pyarrow URI or an fsspec URI."""
    if filesystem is not None:
        return filesystem, location
    if "://" not in location:
        return pafs.LocalFileSystem(), str(Path(location).resolve())
    try:
        return pafs.FileSystem.from_uri(location)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
        pass
    import fsspec  # a dependency of datasets; only needed for protocols pyarrow lacks

    fs, path = fsspec.core.url_to_fs(location)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path


@dataclass
class SourceStats:
    load_seconds: float = 0.0  # listing + reading + splitting shards
    wait_seconds: float = 0.0  # blocked because no group was available
    shards_read: int = 0
    groups_out: int = 0
    dropped: Counter = field(default_factory=Counter)


class ShardSource:
    """Yields complete groups from shards as they land. Not thread-safe: one consumer."""

    def __init__(self, location: str, *, filesystem: pafs.FileSystem | None = None, poll_interval: float = 1.0,
                 max_policy_lag: int | None = None, drop_incomplete: bool = False,
                 cursor: ShardCursor | None = None, rank: int = 0, world_size: int = 1,
                 wait_report_interval: float = 30.0):
        if max_policy_lag is not None and max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0, got {max_policy_lag}")
        if not (world_size >= 1 and 0 <= rank < world_size):
            raise ValueError(f"rank {rank} of world_size {world_size}: need 0 <= rank < world_size")
        self.rank, self.world_size = rank, world_size
        self.fs, self.path = resolve_filesystem(location, filesystem)
        self.location = location
        self.poll_interval = poll_interval
        # A wait for shards says so every this many seconds: a mistyped --shards must not wait in silence.
        self.wait_report_interval = wait_report_interval
        self.max_policy_lag = max_policy_lag
        self.drop_incomplete = drop_incomplete
        self.stats = SourceStats()
        self.versions = VersionOrder()
        self.restore(cursor or ShardCursor(rank=rank, world_size=world_size))

    # -- cursor ---------------------------------------------------------------------------------
    def restore(self, cursor: ShardCursor) -> None:
        if cursor.world_size != self.world_size or cursor.rank != self.rank:
            raise ValueError(f"cursor of rank {cursor.rank} of {cursor.world_size} given to the source of rank "
                             f"{self.rank} of {self.world_size}: the partition differs (groups would repeat or be "
                             "skipped); resume with the world size the checkpoint was made with")
        self._pushed: tuple[Group, ShardCursor] | None = None
        self._last_cursor: ShardCursor | None = None
        self._consumed = list(cursor.consumed)
        self._consumed_set = set(self._consumed)
        self._queued: deque[tuple[str, float]] = deque()
        self._known = set(self._consumed_set)
        self._current: str | None = None
        self._groups: list[Group] = []
        self._offset = 0
        # The partly handed-out shard goes first, and resumes after its handed-out groups.
        self._resume = (cursor.current, cursor.group_offset) if cursor.current else None
        if cursor.current:
            self._queued.append((cursor.current, time.time()))
            self._known.add(cursor.current)

    @property
    def cursor(self) -> ShardCursor:
        if self._pushed is not None:  # the group put back is not handed out
            return self._pushed[1]
        return ShardCursor(list(self._consumed), self._current, self._offset if self._current else 0,
                           self.rank, self.world_size)

    def push_back(self, group: Group) -> None:
        """Return the group ``try_next``/``next_group`` just handed out: it comes out again first."""
        if self._pushed is not None or self._last_cursor is None or self._last_cursor[0] is not group:
            raise RuntimeError("push_back takes only the group handed out last, once")
        self._pushed = (group, self._last_cursor[1])
        self._last_cursor = None
        self.stats.groups_out -= 1

    # -- versions -------------------------------------------------------------------------------
    def set_current_version(self, version: int | str | None) -> None:
        """The server serves ``version`` now: the initial one, then what each sync returned."""
        if version is not None:
            self.versions.learn(str(version))

    @property
    def current_version(self) -> int | None:
        """The current version's position in the sync history (a metric; see VersionOrder)."""
        return self.versions.position

    @property
    def current_version_name(self) -> str | None:
        return self.versions.current

    def lag_of(self, group: Group) -> int | None:
        """How many syncs the group's oldest row is behind the current version; None: unknown."""
        lags = [self.versions.lag(v)[0] for v in group.versions]
        return None if any(x is None for x in lags) else max(lags)

    def drop_reason(self, group: Group) -> tuple[str, str] | None:
        """(category, detail) when the group must be dropped, else None."""
        if self.drop_incomplete and not group.complete:
            return "incomplete", "group timed out in recon (group_complete=false)"
        if self.max_policy_lag is None or self.versions.empty:
            # No order to bound against: the trainer never synced (nothing told it a version) and the data
            # carries no counter. Kept, counted by the rollout (groups_lag_unknown).
            return None
        cur, worst = self.versions.current, None
        for v in group.versions:
            lag, why = self.versions.lag(v)
            if lag is None:
                detail = (f"a row's call spans a weight sync (weight_version {v!r})" if why == "spans_versions" else
                          f"weight_version {v!r} has no place in the sync history {self.versions.history[-5:]} "
                          f"(current {cur!r}): its lag cannot be bounded")
                return why, detail
            if worst is None or lag > worst[0]:
                worst = (lag, v)
        if worst is not None and worst[0] > self.max_policy_lag:
            return "policy_lag", (f"weight_version {worst[1]!r} is {worst[0]} syncs behind {cur!r} > max_policy_lag "
                                  f"{self.max_policy_lag}")
        return None

    # -- reading --------------------------------------------------------------------------------
    def poll(self) -> int:
        """List the directory once and queue new shards; return how many were queued."""
        t0 = time.perf_counter()
        try:
            infos = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        finally:
            self.stats.load_seconds += time.perf_counter() - t0
        now = time.time()
        new = [(seq, i.base_name) for i in infos if i.type == pafs.FileType.File
               and (seq := shard_seq(i.base_name)) is not None and i.base_name not in self._known]
        for _, name in sorted(new):
            self._queued.append((name, now))
            self._known.add(name)
        return len(new)

    def _read(self, name: str, landed_at: float) -> list[Group]:
        t0 = time.perf_counter()
        try:
            table = pq.read_table(f"{self.path.rstrip('/')}/{name}", filesystem=self.fs)
            groups = table_groups(table, name, landed_at)
        finally:
            self.stats.load_seconds += time.perf_counter() - t0
        self.stats.shards_read += 1
        for g in groups:
            for v in g.versions:
                self.versions.saw(v)
        return groups

    def _finish_if_exhausted(self) -> None:
        # Eagerly, so a cursor saved right after the last group of a shard names it consumed.
        if self._current is not None and self._offset >= len(self._groups):
            self._consumed.append(self._current)
            self._consumed_set.add(self._current)
            self._current, self._groups, self._offset = None, [], 0

    def _advance(self) -> bool:
        """Make a group available at self._groups[self._offset]; False if none is queued."""
        while self._current is None or self._offset >= len(self._groups):
            self._finish_if_exhausted()
            if not self._queued:
                return False
            name, landed = self._queued.popleft()
            self._groups = self._read(name, landed)
            self._current, self._offset = name, 0
            if self._resume and self._resume[0] == name:
                self._offset = min(self._resume[1], len(self._groups))
                self._resume = None
        return True

    def try_next(self) -> Group | None:
        """The next group of this rank that passes the filters, without waiting; None if none is available now."""
        if self._pushed is not None:
            g, before = self._pushed
            self._pushed, self._last_cursor = None, (g, before)
            self.stats.groups_out += 1
            return g
        before = self.cursor
        while True:
            if not self._advance():
                self.poll()
                if not self._advance():
                    return None
            g = self._groups[self._offset]
            self._offset += 1
            self._finish_if_exhausted()
            if self.world_size > 1 and group_owner(g.shard, g.index, self.world_size) != self.rank:
                continue  # another rank's group
            reason = self.drop_reason(g)
            if reason is None:
                self.stats.groups_out += 1
                self._last_cursor = (g, before)
                return g
            self.stats.dropped[reason[0]] += 1
            log.warning("dropping group %s of %s: %s", g.group_id, g.shard, reason[1])

    def next_group(self, timeout: float | None = None) -> Group:
        """Block until a group is available (polling every poll_interval) or raise NoShardsError."""
        t0 = time.monotonic()
        reported = None  # when the last "waiting for shards" line was written
        while True:
            g = self.try_next()
            if g is not None:
                self.stats.wait_seconds += time.monotonic() - t0
                return g
            waited = time.monotonic() - t0
            if reported is None and not self.location_exists() or \
                    waited - (reported or 0.0) >= self.wait_report_interval:
                log.warning("%s", self.waiting_line(waited))
                reported = waited
            if timeout is not None and waited >= timeout:
                self.stats.wait_seconds += waited
                raise NoShardsError(
                    f"no complete group in {self.location!r} after {waited:.1f}s "
                    f"({self.stats.shards_read} shards read, groups dropped {dict(self.stats.dropped)}, "
                    f"cursor {self.cursor})")
            time.sleep(self.poll_interval if timeout is None else min(self.poll_interval, timeout - waited))

    def location_exists(self) -> bool:
        try:
            return self.fs.get_file_info(self.path).type != pafs.FileType.NotFound
        except OSError:  # a remote store that cannot say: assume it is there
            return True

    def waiting_line(self, waited: float) -> str:
        """One line for a wait without groups: where, how long, what was seen (and a path that does not exist)."""
        line = (f"waiting for shards in {self.location} ({waited:.0f}s; {len(self._known)} shards seen, "
                f"{self.stats.shards_read} read, {self.stats.groups_out} groups taken"
                + (f", groups dropped {dict(self.stats.dropped)}" if self.stats.dropped else "") + ")")
        if not self.location_exists():
            line += (f": {self.location} does not exist yet; polar-recon build/watch LOGDIR {self.location} writes "
                     "it (check the path; shard_wait_timeout bounds the wait)")
        return line

    def take(self, n: int, timeout: float | None = None) -> list[Group]:
        return [self.next_group(timeout) for _ in range(n)]

    def __iter__(self) -> Iterator[Group]:
        while True:
            yield self.next_group()
