"""The episode log writer used by the addon (no polars, no torch: it runs in the proxy).

Writing: one single-row record batch per call, written straight to the file descriptor (no user
space buffer), so everything written before a SIGKILL is in the page cache and readable. Reopening
an unfinished log (proxy restart) cuts a torn last batch off and appends a new IPC stream to the
same file; the reader reads concatenated streams.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from polar_contracts.episode_ids import validate_episode_id
from polar_contracts.log.end_record import DISCARD, POLAR_INCOMPLETE
from polar_contracts.log.ipcrow import EOS, RowEncoder, schema_message
from polar_contracts.log.schema import COLUMNS, KIND_CALL, KIND_END, KIND_INCOMPLETE, SCHEMA
from polar_contracts.log.table import LogError, full_prompt_arrays, full_requests, pack, read_batches, unpack
from polar_contracts.prefix import common_prefix, shared_ends


class EpisodeFinished(Exception):
    """A write to an episode whose end record is already on disk."""


def _utf8_start(b: bytes, i: int) -> int:
    """Move i back to the start of the UTF-8 character it points into."""
    while 0 < i < len(b) and (b[i] & 0xC0) == 0x80:
        i -= 1
    return i


def request_delta(prev: bytes, new: bytes) -> tuple[int, int, bytes]:
    """(prefix_len, suffix_len, middle): new == prev[:p] + middle + prev[len(prev)-s:], cut on
    UTF-8 character boundaries. Agent requests resend the history and the tools every call, so
    the middle is the new turns only."""
    if not prev:
        return 0, 0, new
    p, s = shared_ends(prev, new)
    p = _utf8_start(new, p)
    while s > 0 and (new[len(new) - s] & 0xC0) == 0x80:  # never start inside a character
        s -= 1
    return p, s, new[p : len(new) - s]


@dataclass(frozen=True)
class PreparedRequest:
    """EpisodeWriter.prepare_request's result: valid while ``base`` is the writer's delta base."""

    base: bytes
    full: bytes
    prefix_len: int
    suffix_len: int
    packed: bytes


@dataclass
class _Recent:
    row: int
    seq: np.ndarray  # prompt + completion


# The row encoder writes each row as one Arrow IPC record batch message (ipcrow.py): ~0.05 ms
# and one write() a row, against ~0.3 ms and one write() per buffer through pyarrow's writer.
_ENCODER = RowEncoder(SCHEMA)
_SCHEMA_MESSAGE = schema_message(SCHEMA)


_APPEND_KEYS = frozenset(COLUMNS) | {"request", "response", "prepared_request"}
# Level 1: an episode's first call packs its whole prompt and request (~80 KB each) on the
# proxy's response path; level 1 takes ~20% less time than 3 for ~5% larger frames.
def warm_up() -> None:
    """Pay one-time costs at start-up, not on the first logged call: pyarrow imports pandas on
    its first pa.array() of a Python list (~0.5 s), and the zstd codec loads lazily."""
    pa.array([0], type=pa.int32())
    unpack(pack(b"warm"))

def _not_a_file(path: Path, st: os.stat_result) -> str:
    what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
    return (f"{path} is {what}: an episode log is never opened through a link or as a special file (someone "
            f"with write access to the log directory put it there; remove it)")


def open_nofollow(path: str | os.PathLike, flags: int, mode: int = 0o644) -> int:
    """os.open with O_NOFOLLOW (and O_CREAT's mode): a symlink planted where a log goes is refused
    (LogError naming it), never followed, so its target is neither created nor written."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            try:
                st = os.lstat(path)
            except OSError:
                raise exc from None
            raise LogError(_not_a_file(Path(path), st)) from None
        raise


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line to a log directory's JSONL file (weight-syncs.jsonl, refused.jsonl) in one
    write (O_APPEND: whole lines from several proxies), never through a symlink."""
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


class EpisodeWriter:
    """Appends rows to one episode's log. Not shared across processes; thread-safe within one."""

    def __init__(self, path: str | os.PathLike, episode_id: str, *, fsync: bool = False, keep: int = 16):
        self.path = Path(path)
        self.episode_id = validate_episode_id(episode_id)
        self.fsync = fsync
        self.keep = keep
        self._lock = threading.Lock()
        self._recent: list[_Recent] = []
        self._rows = 0  # call rows on disk
        self._next_call = 0
        self._last_request = b""  # the previous call row's full request (delta base)
        self.finished = False
        # why this episode's log is incomplete (its "incomplete" rows); marks not yet on disk wait
        # in _marks and go in before the next row (a full disk refuses them too)
        self.incomplete: list[str] = []
        self._marks: list[tuple[int | None, str]] = []
        self._fd: int | None = None
        self._ino = 0
        self._suspended = False
        self._recover()
        self._open_stream(create=True)

    def _open_stream(self, create: bool, fresh: bool = False) -> None:
        """Open the file and start a new IPC stream in it (``fresh``: only in an empty file).
        Nothing stays open when this fails (a failed open must not leak its descriptor: a full
        disk refuses the schema message)."""
        fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0))
        try:
            st = os.fstat(fd)
            if fresh and st.st_size:
                raise LogError(f"{self.path}: the episode's log was deleted while it was running, and "
                               f"another file is there now (never appended to)")
            self._fd, self._size, self._ino = fd, st.st_size, st.st_ino
            self._append(_SCHEMA_MESSAGE)  # a new IPC stream (after the previous writer's, if any)
        except BaseException:
            self._fd, self._ino = None, 0  # (no stream started: a reopen must not continue one)
            os.close(fd)
            raise

    def _recover(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISREG(st.st_mode):
            raise LogError(_not_a_file(self.path, st))
        if st.st_size == 0:
            return
        batches, good_end, torn, open_stream = read_batches(self.path)
        if torn:
            os.truncate(self.path, good_end)
        if open_stream:  # terminate the killed writer's stream so ours can follow it
            fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                os.write(fd, EOS)
            finally:
                os.close(fd)
        table = pa.Table.from_batches(batches, schema=SCHEMA) if batches else SCHEMA.empty_table()
        kinds = table.column("kind").to_pylist()
        if KIND_END in kinds:
            raise EpisodeFinished(f"episode {self.episode_id!r} has already ended ({self.path})")
        if KIND_INCOMPLETE in kinds:
            errors = table.column("error").to_pylist()
            self.incomplete = [errors[i] or "?" for i, k in enumerate(kinds) if k == KIND_INCOMPLETE]
        # Call rows in file order: a row's prompt_base_row counts call rows as they lie in the file.
        calls = table.filter(pa.array([k == KIND_CALL for k in kinds], type=pa.bool_())) if kinds else table
        self._rows = calls.num_rows
        if calls.num_rows:
            last = full_requests(calls)[-1]
            self._last_request = last.encode() if last else b""
            self._next_call = max(i for i in calls.column("call_index").to_pylist() if i is not None) + 1
            start = max(0, calls.num_rows - self.keep)
            prompts = full_prompt_arrays(calls)[start:]
            completions = calls.column("completion_ids").to_pylist()[start:]
            for j, (p, c) in enumerate(zip(prompts, completions)):
                if p is not None:
                    seq = np.concatenate([p, np.asarray(c or [], dtype=np.int32)]).astype(np.int32)
                    self._recent.append(_Recent(start + j, seq))

    def prepare_request(self, req: bytes | str) -> PreparedRequest:
        """The request's delta against the request the next row will be compared with, packed:
        the proxy computes this while the server works, so the row written before the answer
        goes out only checks that the base is still the same (it is, unless another call of
        the episode was written in between; then append_call computes it again)."""
        full = req.encode() if isinstance(req, str) else bytes(req)
        with self._lock:
            base = self._last_request
        p, s, mid = request_delta(base, full)
        return PreparedRequest(base, full, p, s, pack(mid))

    @property
    def calls_written(self) -> int:
        return self._rows

    def next_call_index(self) -> int:
        with self._lock:
            i = self._next_call
            self._next_call += 1
            return i

    def _append(self, data: bytes) -> None:
        """One message, whole or not at all: a failed write (disk full...) is cut off again, so
        the rows after it are not hidden behind a torn message (a reader stops at the first)."""
        fd = self._fd
        if fd is None:
            raise LogError(f"{self.path}: the log is closed")
        try:
            view = memoryview(data)
            while view:  # a regular file takes it in one write() unless the disk fills up
                view = view[os.write(fd, view):]
            if self.fsync:
                os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, self._size)
            except OSError:
                pass
            raise
        self._size += len(data)

    def _write(self, row: dict[str, Any]) -> None:
        self._append(_ENCODER.encode(row))  # one write() a row: readable once it returns

    # -- storage faults ----------------------------------------------------------------------------
    def note_lost(self, call_index: int | None, reason: str) -> None:
        """A call of this episode could not be recorded: an "incomplete" row says so before the
        next row (now, if the disk takes it), and the end record marks the episode discarded."""
        with self._lock:
            self._marks.append((call_index, reason))

    def suspend(self) -> None:
        """Close the file descriptor, keep the writer's state: the next row reopens the file
        (the proxy bounds its open descriptors, addon/open_logs.py). The IPC stream stays open in the
        file; the next row continues it."""
        with self._lock:
            if self._fd is not None and not self.finished:
                os.close(self._fd)
                self._fd = None
                self._suspended = True

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def _ready(self) -> None:
        """Before a row: the file open (reopened after suspend), still linked (a deleted log or
        log directory would swallow rows into an unlinked file: one fstat a row), and the
        pending incomplete marks written."""
        if self._fd is None:
            if not self._suspended:
                raise LogError(f"{self.path}: the log is closed")
            try:
                fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND)
            except FileNotFoundError:
                self._restart("the log file was deleted while the episode was running")
            else:
                st = os.fstat(fd)
                if st.st_ino != self._ino or st.st_size != self._size:
                    os.close(fd)
                    if st.st_size == 0:  # an empty file (a restart the full disk refused): ours to start
                        self._restart("the log file was deleted while the episode was running")
                    else:
                        raise LogError(f"{self.path}: the log file was replaced or changed by someone else "
                                       f"while its writer was suspended")
                else:
                    self._fd, self._suspended = fd, False
        elif os.fstat(self._fd).st_nlink == 0:
            self._restart("the log file (or its directory) was deleted while the episode was running")
        while self._marks:
            idx, reason = self._marks[0]
            self._write(dict(kind=KIND_INCOMPLETE, episode_id=self.episode_id, call_index=idx, error=reason))
            self.incomplete.append(reason)
            self._marks.pop(0)

    def _restart(self, why: str) -> None:
        """The file is gone: a new one at the same path, which says that the rows before are lost."""
        lost = self._rows
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._suspended = True  # (a failed try is tried again at the next row)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open_stream(create=True, fresh=True)
        self._suspended = False
        self._rows, self._recent, self._last_request = 0, [], b""
        self._marks.insert(0, (None, f"{why}: the {lost} call rows before this mark are lost"))

    def append_call(
        self,
        *,
        call_index: int,
        prompt_ids: Iterable[int] | None,
        completion_ids: Iterable[int] | None,
        completion_logprobs: Iterable[float] | None,
        **fields: Any,
    ) -> int:
        """Write one call row; returns its row position. ``prompt_ids`` None means the server gave
        none (then ``error`` must say so); it is never stored as an empty list by accident."""
        unknown = fields.keys() - _APPEND_KEYS
        if unknown:
            raise ValueError(f"unknown log columns {sorted(unknown)}")
        with self._lock:
            if self.finished:
                raise EpisodeFinished(f"episode {self.episode_id!r} has already ended")
            self._ready()
            row = dict(fields)
            row.update(kind=KIND_CALL, episode_id=self.episode_id, call_index=call_index)
            row.setdefault("choice", 0)
            req = row.pop("request", None)
            prepared = row.pop("prepared_request", None)
            # (the writer's state changes only once the row is on disk: a failed write leaves
            # the next row's request delta and prompt base pointing at rows that exist)
            if req is None:
                row.update(request_zstd=None, request_prefix_len=None, request_suffix_len=None)
                last_request = b""
            else:
                full = req.encode() if isinstance(req, str) else bytes(req)
                if prepared is not None and prepared.base is self._last_request and prepared.full == full:
                    p, s, packed = prepared.prefix_len, prepared.suffix_len, prepared.packed
                else:
                    p, s, mid = request_delta(self._last_request, full)
                    packed = pack(mid)
                row.update(request_zstd=packed, request_prefix_len=p, request_suffix_len=s)
                last_request = full
            resp = row.pop("response", None)
            if isinstance(resp, (bytes, bytearray)):  # must read back as text: never store broken UTF-8
                resp = bytes(resp).decode("utf-8", errors="replace")
            row["response_zstd"] = None if resp is None else pack(resp.encode())
            comp = None if completion_ids is None else np.asarray(completion_ids, dtype=np.int32)
            row["completion_ids"] = comp
            row["completion_logprobs"] = (
                None if completion_logprobs is None else np.asarray(completion_logprobs, dtype=np.float32)
            )
            recent = None
            if prompt_ids is None:
                row.update(prompt_base_row=-1, prompt_base_len=0, prompt_tail_zstd=None)
            else:
                prompt = np.asarray(prompt_ids, dtype=np.int32)
                base, n = -1, 0
                for r in reversed(self._recent):
                    if len(r.seq) <= n:  # cannot share more than the best so far
                        continue
                    k = common_prefix(r.seq, prompt)
                    if k > n:
                        base, n = r.row, k
                        if n == len(prompt):  # the whole prompt: nothing can share more
                            break
                row.update(prompt_base_row=base, prompt_base_len=n,
                           prompt_tail_zstd=pack(prompt[n:].astype("<i4", copy=False).tobytes()))
                seq = prompt if comp is None else np.concatenate([prompt, comp])
                recent = _Recent(self._rows, seq)
            self._write(row)
            self._last_request = last_request
            if recent is not None:
                self._recent.append(recent)
                if len(self._recent) > self.keep:
                    self._recent.pop(0)
            self._rows += 1
            return self._rows - 1

    def end(self, reward: float | None, metadata: dict[str, Any] | None = None) -> None:
        """Write the end record and close the file: from now on the episode reads as finished."""
        with self._lock:
            if self.finished:
                raise EpisodeFinished(f"episode {self.episode_id!r} has already ended")
            self._ready()
            metadata = dict(metadata or {})
            if self.incomplete:  # recon never builds it (end_record.is_discarded), and says why
                metadata.update({DISCARD: True, POLAR_INCOMPLETE: list(self.incomplete)})
            self._write(
                dict(
                    kind=KIND_END,
                    episode_id=self.episode_id,
                    reward=None if reward is None else float(reward),
                    metadata=json.dumps(metadata, sort_keys=True),
                )
            )
            self.finished = True
            self._close_locked()

    def _close_locked(self) -> None:
        self._suspended = False
        if self._fd is not None:
            try:
                self._append(EOS)  # the end-of-stream marker
            finally:
                os.close(self._fd)
                self._fd = None
                self._recent.clear()

    def close(self) -> None:
        """Close without ending the episode (proxy shutdown): a later writer appends to it."""
        with self._lock:
            self._close_locked()
