"""Episode logs as Arrow tables (no polars: the proxy's writer uses this module too).

The pyarrow-level reading of a log file (`read_batches`, `read_table`, `full_sequences` /
`full_prompt_arrays`, `full_requests`) and the payload codec (`pack`, `unpack`: 4-byte little-endian raw length + one
zstd frame, see schema.py). A log is one or more concatenated Arrow IPC streams; a torn last batch
(a writer killed mid-write) is cut off, never read.
"""
from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import zstandard

from polar_contracts.log.ipcrow import EOS
from polar_contracts.log.schema import COLUMNS, OLDER_COLUMNS, SCHEMA


class LogError(Exception):
    """A log file that cannot be read at all; the message names the file."""


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
        upgrade = reader.schema.names in OLDER_COLUMNS  # a v2/v3 stream (older proxy): new columns null
        if not upgrade and reader.schema.names != COLUMNS:
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
            batches.append(upgrade_batch(batch) if upgrade else batch)
            good_end = pos + reader_src.tell()
        if torn:
            break
        pos = good_end
    return batches, good_end, torn, open_stream


def upgrade_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """A batch of an older schema (v2, v3) in the current SCHEMA: the columns it lacks are null."""
    n = batch.num_rows
    names = batch.schema.names
    return pa.RecordBatch.from_arrays(
        [batch.column(names.index(f.name)) if f.name in names else pa.nulls(n, f.type) for f in SCHEMA],
        schema=SCHEMA)


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

def list_column(col: pa.ChunkedArray, dtype) -> list[np.ndarray | None]:
    """A list<...> column as one numpy view per row (None for null rows), without Python lists."""
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if len(arr) == 0:
        return []
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(arr))]


def prompt_tails(table: pa.Table) -> list[np.ndarray | None]:
    """The stored prompt tails as int32 arrays, whichever layout the table uses: a list column, or
    packed (length + zstd frame, see `unpack`) little-endian int32."""
    names = table.schema.names
    if "prompt_tail_ids" in names:
        return list_column(table.column("prompt_tail_ids"), np.int32)
    if "prompt_tail_zstd" in names:
        return [None if b is None else np.frombuffer(unpack(b), dtype="<i4").astype(np.int32, copy=False)
                for b in table.column("prompt_tail_zstd").to_pylist()]
    raise LogError(f"log schema has no prompt tail column (columns: {names})")


_EMPTY = np.zeros(0, dtype=np.int32)


def full_sequences(table: pa.Table) -> tuple[list[np.ndarray | None], list[int]]:
    """The one decoder of the prefix compression. For each row of a call-rows table (on-disk
    SCHEMA, end rows removed): its full prompt + completion as one int32 array (None: no ids), and
    its prompt's length (the prompt and completion are views of that one array). Rows reference
    earlier rows by position; a reference that cannot be used is a LogError."""
    bases = table.column("prompt_base_row").to_pylist()
    lens = table.column("prompt_base_len").to_pylist()
    tails = prompt_tails(table)
    comps = list_column(table.column("completion_ids"), np.int32)
    seqs: list[np.ndarray | None] = []
    prompt_lens: list[int] = []
    for i, (base, n, tail, comp) in enumerate(zip(bases, lens, tails, comps, strict=True)):
        if tail is None:
            seqs.append(None)
            prompt_lens.append(0)
            continue
        head = _EMPTY
        if base is not None and base >= 0:
            n = n or 0
            if base >= i or seqs[base] is None or n > len(seqs[base]):
                raise LogError(f"row {i} references prompt base row {base} that cannot be used")
            head = seqs[base][:n]
        # one copy per call: the prompt and completion are views into it
        seqs.append(np.concatenate([head, tail, comp if comp is not None else _EMPTY]))
        prompt_lens.append(len(head) + len(tail))
    return seqs, prompt_lens


def full_prompt_arrays(table: pa.Table) -> list[np.ndarray | None]:
    """The full prompt ids of each row of a call-rows table (on-disk SCHEMA, end rows removed)
    as int32 arrays (views into `full_sequences`)."""
    seqs, lens = full_sequences(table)
    return [None if s is None else s[:n] for s, n in zip(seqs, lens, strict=True)]


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




# Level 1: an episode's first call packs its whole prompt and request (~80 KB each) on the
# proxy's response path; level 1 takes ~20% less time than 3 for ~5% larger frames.
ZSTD_LEVEL = 1
_CODEC = pa.Codec("zstd", compression_level=ZSTD_LEVEL)
_CODEC_LOCK = threading.Lock()
# One reusable compression context: pyarrow's codec makes a fresh one per call, ~20 us of fixed
# cost, x3 payloads per row on the proxy's response path. The frame is standard zstd either way.
_COMPRESS = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress


def pack(data: bytes) -> bytes:
    """4-byte little-endian raw length + one zstd frame (see schema.py)."""
    with _CODEC_LOCK:  # one reusable compressor (not thread-safe: hence the lock)
        return struct.pack("<I", len(data)) + _COMPRESS(data)


def unpack(blob: bytes) -> bytes:
    if len(blob) < 4:
        raise LogError(f"packed payload of {len(blob)} bytes is too short")
    (n,) = struct.unpack_from("<I", blob)
    if n == 0:
        return b""
    with _CODEC_LOCK:
        return _CODEC.decompress(blob[4:], decompressed_size=n, asbytes=True)
