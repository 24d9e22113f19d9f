"""One-row Arrow IPC record batch messages, encoded directly (the log writer's hot path).

The proxy writes one record batch per model call. Through pyarrow that costs ~0.3 ms a row:
~30 one-row arrays, a RecordBatch, and a stream writer that issues one write() per buffer. The
schema is fixed and every batch has one row, so the message always has the same shape: the same
field nodes, the same buffers, only their lengths and the bytes differ. This module writes that
message itself (the Arrow IPC "encapsulated message" format: continuation marker, flatbuffer
``Message`` with a ``RecordBatch`` header, then the 8-byte-aligned body), for one write() per row.

The format is Arrow's, not ours: pyarrow reads these messages like its own (tests/recon/
test_ipcrow.py compares them with pyarrow's encoding of the same rows, field by field, and reads
them back through ``pa.ipc.open_stream``). Types covered are the log schema's: string, binary,
int32, float64, bool, and list<int32 | float32 | string>.
"""
from __future__ import annotations

import struct
import sys
from array import array
from typing import Any

import numpy as np
import pyarrow as pa

CONTINUATION = b"\xff\xff\xff\xff"
EOS = CONTINUATION + b"\x00\x00\x00\x00"
_METADATA_V5 = 4  # org.apache.arrow.flatbuf.MetadataVersion.V5
_HEADER_RECORD_BATCH = 3  # org.apache.arrow.flatbuf.MessageHeader.RecordBatch
_ZERO8 = bytes(8)
_NULL_BITMAP = b"\x00"  # one row, not valid
_TRUE_BITMAP = b"\x01"
# Values that repeat row after row (null, kind, api, dialect, status, booleans, short strings)
# are encoded once per column: (field nodes, buffer lengths, padded body bytes).
_CACHEABLE = frozenset({str, int, bool})
_DOUBLE = struct.Struct("<d")
_VALID_NODE = (1, 0)
_DOUBLE_LENS = (0, 8)
_OFFSETS = struct.Struct("<ii")
_INT32 = struct.Struct("<i")
_INT32_LENS = (0, 4)
_INT32_PADDED = struct.Struct("<i4x")  # the value and its padding to 8 bytes
_CACHE_MAX = 512

# Leaf kinds: how one value is laid out in buffers.
_VAR = "var"  # string / binary: validity, int32 offsets, data
_FIXED = "fixed"  # int32 / float64: validity, data
_BOOL = "bool"  # validity, bit-packed data
_LIST = "list"  # validity, int32 offsets; then the child's buffers


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class _Field:
    __slots__ = ("name", "kind", "fmt", "child", "dtype", "utf8", "cache", "typecode")

    def __init__(self, field: pa.Field, top: bool = True):
        t = field.type
        self.name = field.name
        self.child = None
        self.fmt = None
        self.dtype = None
        self.utf8 = pa.types.is_string(t)
        self.cache: dict[tuple, tuple] = {}
        self.typecode = None  # the array.array typecode of the same layout, if any
        if pa.types.is_string(t) or pa.types.is_binary(t):
            self.kind = _VAR
        elif pa.types.is_int32(t):
            self.kind, self.fmt, self.dtype = _FIXED, _INT32, np.dtype("<i4")
            self.typecode = "i" if array("i").itemsize == 4 and sys.byteorder == "little" else None
        elif pa.types.is_float64(t):
            self.kind, self.fmt, self.dtype = _FIXED, _DOUBLE, np.dtype("<f8")
        elif pa.types.is_float32(t):
            self.kind, self.fmt, self.dtype = _FIXED, struct.Struct("<f"), np.dtype("<f4")
            self.typecode = "f" if sys.byteorder == "little" else None
        elif pa.types.is_boolean(t):
            self.kind = _BOOL
        elif pa.types.is_list(t) and top:
            self.kind = _LIST
            self.child = _Field(t.value_field, top=False)
        else:
            raise TypeError(f"ipcrow: column {field.name!r} has unsupported type {t}")

    @property
    def n_nodes(self) -> int:
        return 1 + (self.child.n_nodes if self.child is not None else 0)

    @property
    def n_buffers(self) -> int:
        own = 3 if self.kind == _VAR else 2  # var: validity, offsets, data; others: validity + one
        return own + (self.child.n_buffers if self.child is not None else 0)


class RowEncoder:
    """Encodes one-row record batches of ``schema`` (a dict per row, missing keys are null)."""

    def __init__(self, schema: pa.Schema):
        self.schema = schema
        self.fields = [_Field(f) for f in schema]
        n_nodes = sum(f.n_nodes for f in self.fields)
        n_bufs = sum(f.n_buffers for f in self.fields)
        self._layout(n_nodes, n_bufs)

    # -- the flatbuffer: a fixed layout, values patched per row ----------------------------------
    def _layout(self, n_nodes: int, n_bufs: int) -> None:
        """Message { version, header_type, header -> RecordBatch { length, nodes, buffers },
        bodyLength } laid out once, with every int64 8-aligned (positions relative to the start
        of the flatbuffer, which starts 8 bytes into the 8-aligned message)."""
        # root offset (u32) @0 | Message vtable @4 (12 bytes) | Message table @16 (24 bytes)
        # | RecordBatch vtable @40 (10 bytes, +2 pad) | RecordBatch table @52 (20 bytes)
        # | pad @72 | nodes: count @76, structs @80 | pad | buffers: count, structs (8-aligned)
        nodes_at = 80
        bufs_count_at = nodes_at + 16 * n_nodes + 4
        bufs_at = bufs_count_at + 4
        size = _pad8(bufs_at + 16 * n_bufs)
        head = bytearray(size)
        struct.pack_into("<I", head, 0, 16)  # root: the Message table
        # Message vtable: vtable bytes, table bytes, offsets of version, header_type, header, bodyLength
        struct.pack_into("<HHHHHH", head, 4, 12, 24, 4, 6, 16, 8)
        struct.pack_into("<i", head, 16, 16 - 4)  # table -> its vtable
        struct.pack_into("<hB", head, 20, _METADATA_V5, _HEADER_RECORD_BATCH)
        # bodyLength @24 (patched per row)
        struct.pack_into("<I", head, 32, 52 - 32)  # header -> RecordBatch table
        # RecordBatch vtable: vtable bytes, table bytes, offsets of length, nodes, buffers
        struct.pack_into("<HHHHH", head, 40, 10, 20, 4, 12, 16)
        struct.pack_into("<i", head, 52, 52 - 40)
        struct.pack_into("<q", head, 56, 1)  # one row
        struct.pack_into("<I", head, 64, 76 - 64)  # -> nodes vector
        struct.pack_into("<I", head, 68, bufs_count_at - 68)  # -> buffers vector
        struct.pack_into("<I", head, 76, n_nodes)
        struct.pack_into("<I", head, bufs_count_at, n_bufs)
        self._head = bytes(head)
        self._prefix = CONTINUATION + struct.pack("<i", size)
        self._body_len_at = 24
        self._nodes_at = nodes_at
        self._bufs_at = bufs_at
        self._nodes_fmt = struct.Struct(f"<{2 * n_nodes}q")
        self._spans = np.zeros((n_bufs, 2), dtype="<i8")  # scratch (the encoder is not shared across threads)

    # -- values ----------------------------------------------------------------------------------
    def encode(self, row: dict[str, Any]) -> bytes:
        """The encapsulated message of one row (``row``: column -> value, missing means null)."""
        nodes: list[int] = []
        lens: list[int] = []
        body: list[bytes] = []
        get = row.get
        for f in self.fields:
            v = get(f.name)
            cache = f.cache
            if type(v) is float and f.fmt is _DOUBLE:  # the timestamps: never repeat
                nodes += _VALID_NODE
                lens += _DOUBLE_LENS
                body.append(_DOUBLE.pack(v))
                continue
            if type(v) is int and f.fmt is _INT32 and -0x80000000 <= v <= 0x7FFFFFFF:  # call index, rows
                nodes += _VALID_NODE
                lens += _INT32_LENS
                body.append(_INT32_PADDED.pack(v))
                continue
            if type(v) is bytes and f.kind is _VAR and not f.utf8:  # the packed payloads
                n = len(v)
                nodes += _VALID_NODE
                lens += (0, 8, n)
                body += (_OFFSETS.pack(0, n), v, _ZERO8[: ((n + 7) & ~7) - n])
                continue
            if f.child is not None and (
                    (type(v) is np.ndarray and v.dtype == f.child.dtype and v.ndim == 1)
                    or (type(v) is array and v.typecode == f.child.typecode)):
                n, data = len(v), v.tobytes()  # the completion ids / logprobs (the addon's arrays)
                nodes += (1, 0, n, 0)
                lens += (0, 8, 0, len(data))
                body += (_OFFSETS.pack(0, n), data, _ZERO8[: ((len(data) + 7) & ~7) - len(data)])
                continue
            if v is None or (type(v) in _CACHEABLE and (type(v) is not str or len(v) <= 64)):
                key = (type(v), v)
                part = cache.get(key)
                if part is None:
                    if len(cache) >= _CACHE_MAX:
                        cache.clear()
                    part = cache[key] = _part(f, v)
            else:
                part = _part(f, v)
            nodes += part[0]
            lens += part[1]
            body.append(part[2])
        # buffers lie back to back in the body, each padded to 8 bytes: (offset, length) pairs
        spans = self._spans
        spans[:, 1] = lens
        ends = np.cumsum((spans[:, 1] + 7) & ~7)
        spans[1:, 0] = ends[:-1]
        head = bytearray(self._head)
        struct.pack_into("<q", head, self._body_len_at, int(ends[-1]))
        self._nodes_fmt.pack_into(head, self._nodes_at, *nodes)
        head[self._bufs_at: self._bufs_at + spans.nbytes] = spans.tobytes()
        return b"".join((self._prefix, head, *body))




def _part(f: _Field, v: Any) -> tuple[tuple[int, ...], tuple[int, ...], bytes]:
    nodes: list[int] = []
    bufs: list[bytes] = []
    if v is None:
        _null(f, nodes, bufs)
    else:
        _value(f, v, nodes, bufs)
    return tuple(nodes), tuple(len(b) for b in bufs), b"".join(b + _ZERO8[: _pad8(len(b)) - len(b)] for b in bufs)


def _null(f: _Field, nodes: list[int], bufs: list[bytes]) -> None:
    nodes += (1, 1)
    bufs.append(_NULL_BITMAP)
    if f.kind == _VAR or f.kind == _LIST:
        bufs.append(_ZERO8)  # offsets [0, 0]
        if f.kind == _VAR:
            bufs.append(b"")
    elif f.kind == _FIXED:
        bufs.append(bytes(f.fmt.size))
    else:  # _BOOL
        bufs.append(b"\x00")
    if f.child is not None:  # the empty child of a null list
        c = f.child
        nodes += (0, 0)
        bufs.append(b"")
        bufs.append(b"\x00\x00\x00\x00" if c.kind == _VAR else b"")  # offsets [0] / no values
        if c.kind == _VAR:
            bufs.append(b"")


def _value(f: _Field, v: Any, nodes: list[int], bufs: list[bytes]) -> None:
    nodes += (1, 0)
    bufs.append(b"")  # validity: all valid, no bitmap
    kind = f.kind
    if kind == _VAR:
        data = _var_bytes(f, v)
        bufs.append(struct.pack("<ii", 0, len(data)))
        bufs.append(data)
    elif kind == _FIXED:
        ok = (int, np.integer) if f.dtype.kind == "i" else (int, float, np.integer, np.floating)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, ok):
            raise TypeError(f"column {f.name!r}: expected {'an int' if f.dtype.kind == 'i' else 'a number'}, "
                            f"got {type(v).__name__}")
        try:
            bufs.append(f.fmt.pack(v))
        except struct.error as exc:
            raise OverflowError(f"column {f.name!r}: {v!r} does not fit ({exc})") from None
    elif kind == _BOOL:
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"column {f.name!r}: expected a bool, got {type(v).__name__}")
        bufs.append(_TRUE_BITMAP if v else b"\x00")
    else:  # _LIST
        c = f.child
        if c.kind == _VAR:
            if any(s is None for s in v):
                raise TypeError(f"column {f.name!r}: null list items are not supported")
            items = [_var_bytes(c, s) for s in v]
            offs = np.zeros(len(items) + 1, dtype="<i4")
            np.cumsum([len(s) for s in items], out=offs[1:])
            bufs.append(struct.pack("<ii", 0, len(items)))
            nodes += (len(items), 0)
            bufs += (b"", offs.tobytes(), b"".join(items))
        else:
            arr = np.asarray(v, dtype=c.dtype)
            if arr.ndim != 1:
                raise TypeError(f"column {f.name!r}: expected a flat list")
            bufs.append(struct.pack("<ii", 0, len(arr)))
            nodes += (len(arr), 0)
            bufs += (b"", arr.tobytes())


def _var_bytes(f: _Field, v: Any) -> bytes:
    if f.utf8:
        if not isinstance(v, str):
            raise TypeError(f"column {f.name!r}: expected a str, got {type(v).__name__}")
        return v.encode("utf-8")
    if not isinstance(v, (bytes, bytearray, memoryview)):
        raise TypeError(f"column {f.name!r}: expected bytes, got {type(v).__name__}")
    return bytes(v)


def schema_message(schema: pa.Schema) -> bytes:
    """The stream's opening schema message, as pyarrow writes it."""
    return schema.serialize().to_pybytes()
