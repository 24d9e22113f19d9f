"""Episode log files: the writer used by the addon and the one reader (`read_log`).

Writing: one single-row record batch per call, written straight to the file descriptor (no user
space buffer), so everything written before a SIGKILL is in the page cache and readable. Reopening
an unfinished log (proxy restart) cuts a torn last batch off and appends a new IPC stream to the
same file; the reader reads concatenated streams.
"""
from __future__ import annotations

import json
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import polars as pl
import pyarrow as pa

from .ipcrow import EOS, RowEncoder, schema_message
from .logschema import COLUMNS, KIND_CALL, KIND_END, READ_DROP, SCHEMA

EPISODE_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class LogError(Exception):
    """A log file that cannot be read at all; the message names the file."""


class EpisodeFinished(Exception):
    """A write to an episode whose end record is already on disk."""


def validate_episode_id(episode_id: str) -> str:
    """Return the id if it is safe as a file name in LOGDIR, else raise ValueError naming it."""
    if not isinstance(episode_id, str) or not EPISODE_ID_RE.match(episode_id) or episode_id in (".", ".."):
        raise ValueError(
            f"invalid episode id {episode_id!r}: must match [A-Za-z0-9._-]{{1,128}} and not be '.' or '..'"
        )
    return episode_id


def episode_path(logdir: str | os.PathLike, episode_id: str) -> Path:
    return Path(logdir) / f"{validate_episode_id(episode_id)}.arrow"


# ---------------------------------------------------------------------------------------------
# reading


def read_batches(path: str | os.PathLike) -> tuple[list[pa.RecordBatch], int, bool, bool]:
    """Public, numpy-level reading starts here (also ``read_table``, ``full_prompt_arrays``,
    ``full_requests``, ``unpack``). All complete batches of all concatenated streams, the byte offset after the last complete
    message, whether a torn/invalid tail was found, and whether the last stream is open (no
    end-of-stream marker: its writer was killed or is still writing)."""
    path = Path(path)
    data = pa.memory_map(str(path), "r").read_buffer() if path.stat().st_size else pa.py_buffer(b"")
    size = data.size
    batches: list[pa.RecordBatch] = []
    pos = 0
    good_end = 0
    torn = False
    open_stream = False
    while pos < size:
        reader_src = pa.BufferReader(data.slice(pos))
        try:
            reader = pa.ipc.open_stream(reader_src)
        except (pa.ArrowInvalid, OSError) as exc:
            if not batches and pos == 0:
                raise LogError(f"{path}: not an Arrow IPC stream ({exc})") from exc
            torn = True
            break
        if reader.schema.names != COLUMNS:
            raise LogError(f"{path}: unexpected columns {reader.schema.names}")
        good_end = pos + reader_src.tell()  # after the schema message
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                # after the end-of-stream marker, or at the end of an unterminated stream
                good_end = pos + reader_src.tell()
                open_stream = good_end >= size and not _ends_with_eos(data, good_end)
                break
            except (pa.ArrowInvalid, OSError):
                torn = True
                open_stream = True
                break
            batches.append(batch)
            good_end = pos + reader_src.tell()
        if torn:
            break
        pos = good_end
    return batches, good_end, torn, open_stream


_read_batches = read_batches  # the old private name (polar_recon/episodes.py)


def read_table(path: str | os.PathLike, columns: list[str] | None = None) -> tuple[pa.Table, bool]:
    """Every row of a log as one Arrow table in the on-disk SCHEMA (optionally only ``columns``),
    and whether a torn last batch was cut off. Raises LogError naming the file."""
    path = Path(path)
    if not path.exists():
        raise LogError(f"{path}: no such log")
    batches, _, torn, _ = read_batches(path)
    table = pa.Table.from_batches(batches, schema=SCHEMA) if batches else SCHEMA.empty_table()
    return (table.select(columns) if columns is not None else table), torn


def _ends_with_eos(data: pa.Buffer, end: int) -> bool:
    return end >= 8 and data.slice(end - 8, 8).to_pybytes() == EOS


@dataclass
class EpisodeLog:
    path: Path
    episode_id: str
    calls: pl.DataFrame  # one row per call (per choice), full prompt_ids, sorted by call_index
    finished: bool  # an end record is on disk
    reward: float | None
    metadata: dict[str, Any]
    truncated: bool  # a torn last batch was found (writer killed mid-write)


def full_prompt_arrays(table: pa.Table) -> list[np.ndarray | None]:
    """The full prompt ids of each row of a call-rows table (on-disk SCHEMA, end rows removed)
    as int32 arrays: undoes the prefix compression (rows reference earlier rows by position)."""
    bases = table.column("prompt_base_row").to_pylist()
    lens = table.column("prompt_base_len").to_pylist()
    tails = [None if b is None else np.frombuffer(unpack(b), dtype="<i4")
             for b in table.column("prompt_tail_zstd").to_pylist()]
    comps = table.column("completion_ids").to_numpy(zero_copy_only=False)
    seqs: list[np.ndarray | None] = []
    prompts: list[np.ndarray | None] = []
    for i, (base, n, tail, comp) in enumerate(zip(bases, lens, tails, comps)):
        if tail is None:
            seqs.append(None)
            prompts.append(None)
            continue
        tail = np.asarray(tail, dtype=np.int32)
        if base is not None and base >= 0:
            if base >= i or seqs[base] is None or n > len(seqs[base]):
                raise LogError(f"row {i} references prompt base row {base} that cannot be used")
            prompt = np.concatenate([seqs[base][:n], tail])
        else:
            prompt = tail
        comp = np.asarray(comp if comp is not None else [], dtype=np.int32)
        seqs.append(np.concatenate([prompt, comp]))
        prompts.append(prompt)
    return prompts


def _full_prompts(table: pa.Table) -> list[list[int] | None]:
    return [None if p is None else p.tolist() for p in full_prompt_arrays(table)]


def full_requests(table: pa.Table) -> list[str | None]:
    """Undo the request delta: each call row's request is relative to the previous call row's."""
    mids = [None if b is None else unpack(b) for b in table.column("request_zstd").to_pylist()]
    pres = table.column("request_prefix_len").to_pylist()
    sufs = table.column("request_suffix_len").to_pylist()
    prev = b""
    out: list[str | None] = []
    for i, (mid, p, s) in enumerate(zip(mids, pres, sufs)):
        if mid is None:
            out.append(None)
            prev = b""
            continue
        p, s = p or 0, s or 0
        if p + s > len(prev):
            raise LogError(f"row {i}: request delta needs {p}+{s} bytes of a {len(prev)}-byte base")
        full = prev[:p] + mid + prev[len(prev) - s :]
        out.append(full.decode())
        prev = full
    return out


_full_requests = full_requests  # the old private name (polar_recon/episodes.py)


def read_episode(path: str | os.PathLike) -> EpisodeLog:
    path = Path(path)
    if not path.exists():
        raise LogError(f"{path}: no such log")
    batches, _, torn, _ = read_batches(path)
    table = pa.Table.from_batches(batches, schema=SCHEMA) if batches else SCHEMA.empty_table()
    kinds = table.column("kind").to_pylist()
    end_rows = [i for i, k in enumerate(kinds) if k == KIND_END]
    reward = None
    metadata: dict[str, Any] = {}
    if end_rows:
        last = end_rows[-1]
        reward = table.column("reward")[last].as_py()
        meta = table.column("metadata")[last].as_py()
        metadata = json.loads(meta) if meta else {}
    call_mask = pa.array([k == KIND_CALL for k in kinds], type=pa.bool_())
    calls = table.filter(call_mask) if len(kinds) else table
    try:
        prompts = _full_prompts(calls)
        requests = full_requests(calls)
    except LogError as exc:
        raise LogError(f"{path}: {exc}") from exc
    responses = [None if b is None else unpack(b).decode() for b in calls.column("response_zstd").to_pylist()]
    calls = calls.drop_columns(list(READ_DROP))
    calls = calls.append_column("request", pa.array(requests, type=pa.string()))
    calls = calls.append_column("response", pa.array(responses, type=pa.string()))
    calls = calls.append_column(
        pa.field("prompt_ids", pa.list_(pa.int32())), pa.array(prompts, type=pa.list_(pa.int32()))
    )
    df = pl.from_arrow(calls)
    assert isinstance(df, pl.DataFrame)
    df = df.sort(["call_index", "choice"], maintain_order=True, nulls_last=True)
    episode_id = path.name[: -len(".arrow")] if path.name.endswith(".arrow") else path.stem
    return EpisodeLog(path, episode_id, df, bool(end_rows), reward, metadata, torn)


def read_log(path: str | os.PathLike) -> pl.DataFrame:
    """The calls of one episode log as a polars DataFrame with full ``prompt_ids``."""
    return read_episode(path).calls


def is_finished(path: str | os.PathLike) -> bool:
    try:
        return read_episode(path).finished
    except LogError:
        return False


# ---------------------------------------------------------------------------------------------
# writing


def common_prefix(a, b) -> int:
    """Length of the common prefix of two int arrays, or of two bytes-like objects (bytes,
    memoryview: compared as bytes, without copies)."""
    if not isinstance(a, np.ndarray):
        a, b = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    n = min(len(a), len(b))
    if n == 0:
        return 0
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def shared_ends(a: bytes, b: bytes) -> tuple[int, int]:
    """(p, s): b shares its first p and its last s bytes with a, p + s <= min(len(a), len(b))."""
    if a == b:  # (a memcmp) a harness retrying, or a loop resending the same request
        return len(b), 0
    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    p = common_prefix(x, y)
    m = min(len(x), len(y)) - p  # the suffix may not overlap the prefix in either string
    return p, common_prefix(x[len(x) - m:][::-1], y[len(y) - m:][::-1]) if m > 0 else 0


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
_ZSTD_LEVEL = 1
_CODEC = pa.Codec("zstd", compression_level=_ZSTD_LEVEL)
_CODEC_LOCK = threading.Lock()


def warm_up() -> None:
    """Pay one-time costs at start-up, not on the first logged call: pyarrow imports pandas on
    its first pa.array() of a Python list (~0.5 s), and the zstd codec loads lazily."""
    pa.array([0], type=pa.int32())
    unpack(pack(b"warm"))


try:  # (a dependency of mitmproxy) keeps one compression context: pyarrow's codec makes a fresh
    # one per call, ~20 us of fixed cost, x3 payloads per row on the proxy's response path
    import zstandard as _zstd

    _COMPRESS = _zstd.ZstdCompressor(level=_ZSTD_LEVEL).compress
except ImportError:  # pragma: no cover - the same standard zstd frame from pyarrow
    _COMPRESS = None


def pack(data: bytes) -> bytes:
    """4-byte little-endian raw length + one zstd frame (see logschema)."""
    with _CODEC_LOCK:  # one reusable compressor (not thread-safe: hence the lock)
        frame = _COMPRESS(data) if _COMPRESS is not None else _CODEC.compress(data, asbytes=True)
        return struct.pack("<I", len(data)) + frame


def unpack(blob: bytes) -> bytes:
    if len(blob) < 4:
        raise LogError(f"packed payload of {len(blob)} bytes is too short")
    (n,) = struct.unpack_from("<I", blob)
    if n == 0:
        return b""
    with _CODEC_LOCK:
        return _CODEC.decompress(blob[4:], decompressed_size=n, asbytes=True)


def read_file_order_requests(path: Path) -> str | None:
    """The full request of the last call row in file order (the next row's delta base)."""
    batches, _, _, _ = read_batches(path)
    table = pa.Table.from_batches(batches, schema=SCHEMA) if batches else SCHEMA.empty_table()
    kinds = table.column("kind").to_pylist()
    calls = table.filter(pa.array([k == KIND_CALL for k in kinds], type=pa.bool_())) if kinds else table
    reqs = full_requests(calls)
    return reqs[-1] if reqs else None


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
        self._recover()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        self._append(_SCHEMA_MESSAGE)  # a new IPC stream (after the previous writer's, if any)

    def _recover(self) -> None:
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        batches, good_end, torn, open_stream = read_batches(self.path)
        if torn:
            os.truncate(self.path, good_end)
        if open_stream:  # terminate the killed writer's stream so ours can follow it
            with open(self.path, "ab") as f:
                f.write(EOS)
        ep = read_episode(self.path)
        if ep.finished:
            raise EpisodeFinished(f"episode {self.episode_id!r} has already ended ({self.path})")
        calls = ep.calls
        self._rows = calls.height
        if calls.height:
            last = read_file_order_requests(self.path)
            self._last_request = last.encode() if last else b""
            self._next_call = int(calls["call_index"].max()) + 1
            tail = calls.tail(self.keep)
            start = calls.height - tail.height
            for j, (p, c) in enumerate(zip(tail["prompt_ids"].to_list(), tail["completion_ids"].to_list())):
                if p is not None:
                    self._recent.append(_Recent(start + j, np.asarray(p + (c or []), dtype=np.int32)))

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
            self._write(
                dict(
                    kind=KIND_END,
                    episode_id=self.episode_id,
                    reward=None if reward is None else float(reward),
                    metadata=json.dumps(metadata or {}, sort_keys=True),
                )
            )
            self.finished = True
            self._close_locked()

    def _close_locked(self) -> None:
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
