"""The top-level fields of a request body, without building the whole body in Python.

Deciding which id/logprob flags to add needs a handful of top-level keys of an 80 KB agent
request (``stream``, ``logprobs``, the ``return_*`` flags, ``n``, ``model``), not its messages and
tools. orjson builds every message, part and tool schema as Python objects (~0.1 ms for 80 KB
here, plus freeing them); simdjson (pysimdjson) parses and validates the same bytes into a C
tape in ~0.03 ms and hands out only the values asked for. The proxy forwards nothing until this
parse is done, so this is the request path's latency.

The fast parser only answers; it never decides an error. Whatever it refuses (invalid JSON, an
integer past 64 bits, which orjson reads as a float) or does not return as an object goes to
orjson, which gives the same answers and error messages as before. Without pysimdjson installed
every body goes to orjson.

``int_list`` uses the same parser for the other big JSON in a call: a prompt's token id list,
read into an int64 array without a Python int per id (idlists.parse_ids).
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import simdjson as _simdjson  # a dependency (setup.cfg); tests set this to None to compare with orjson

_local = threading.local()


def _parser():
    parser = getattr(_local, "parser", None)
    if parser is None:
        # one parser per thread, reused: a fresh one allocates its buffers (several times the
        # body) on every call. No value of a document outlives the functions here, so reuse is safe.
        parser = _local.parser = _simdjson.Parser()
    return parser


def int_list(data: bytes) -> np.ndarray | None:
    """A JSON array of integers (``[...]`` bytes) as int64, parsed in C without a Python int per
    element (orjson builds 20k ints for a 20k-token prompt: ~1 ms here); None when the array is
    not all integers (then use orjson)."""
    if _simdjson is None:
        return None
    try:
        doc = _parser().parse(data)
        try:
            buf = doc.as_buffer(of_type="i")
        finally:
            del doc
    except Exception:  # noqa: BLE001 - not an array, not all ints, past 64 bits, invalid
        return None
    return np.frombuffer(buf, dtype=np.int64)


def request_head(raw: bytes, keys: Iterable[str]) -> tuple[dict[str, Any], int] | None:
    """``({key: value} for those of ``keys`` the top-level object has, number of top-level
    keys)``, or None when the fast parser cannot answer (then parse the body with orjson).
    Nested values come back as plain Python objects."""
    if _simdjson is None or not raw:
        return None
    try:
        doc = _parser().parse(raw)
    except Exception:  # noqa: BLE001 - ValueError, RuntimeError (big ints), UnicodeDecodeError
        return None
    try:
        if not isinstance(doc, _simdjson.Object):
            return None
        # one pass over the names: `key in doc` walks the object again for every key asked
        # (~3 us each past an 80 KB messages array), so only the keys present are looked up
        names = list(doc.keys())
        if len(set(names)) != len(names):  # a repeated key: simdjson reads the first, servers the last
            return None
        wanted = keys if isinstance(keys, (set, frozenset)) else frozenset(keys)
        return {k: _plain(doc[k]) for k in names if k in wanted}, len(names)
    finally:
        del doc


def _plain(v: Any) -> Any:
    if isinstance(v, _simdjson.Object):
        return v.as_dict()
    if isinstance(v, _simdjson.Array):
        return v.as_list()
    return v
