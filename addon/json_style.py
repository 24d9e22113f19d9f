"""How the proxy writes back JSON it changed (sans-IO): in the style the server wrote it.

An answer the proxy strips its own fields from (the token ids and logprobs it asked for) must
reach the harness as the server's bytes less those fields: the server's separators, each number's
text, its non-ASCII characters raw or escaped, every string escape as written. Servers differ
(aiohttp's json_response uses json.dumps defaults, FastAPI and pydantic are compact), so the style
is read from the bytes themselves (``json_style``).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import orjson


def dumps_like_python(obj: Any) -> bytes:
    """Re-serialize the way Python JSON servers do (FastAPI: compact separators, UTF-8 kept), so an
    event the proxy changed differs from the server's bytes only where it removed something."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode()
    except UnicodeEncodeError:  # a lone surrogate (valid JSON, no UTF-8): escaped, as the server wrote it
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=True).encode()


_FIRST_SEP = re.compile(rb'\A\s*[\[{]\s*"(?:[^"\\]|\\.)*"(\s*):(\s*)')
# An escape that only ensure_ascii=True writes: a character past ASCII, or DEL (0x7f; control
# characters below 0x20 are escaped either way, so they say nothing)
_HIGH_ESCAPE = re.compile(rb"\\u(?:007[fF]|00[89a-fA-F]|0[1-9a-fA-F]|[1-9a-fA-F])")
_DUMPERS: dict[tuple[str, str, bool], Callable[[Any], bytes]] = {}
COMPACT_UTF8 = (",", ":", False)


def dumps_fast(obj: Any) -> bytes:
    """Compact UTF-8 JSON via orjson: byte-identical to json.dumps(separators=(",", ":"),
    ensure_ascii=False) for strings, ints, bools and null, 5x faster. Not for floats (orjson
    writes 1e-05 as 0.00001), so only for objects the proxy knows carry none."""
    return orjson.dumps(obj)


def _int_text(s: str) -> Any:
    return int(s) if len(s) < 19 else orjson.Fragment(s)  # (orjson writes no int past 64 bits)


def loads_faithful(raw: bytes | str) -> Any:
    """Parse keeping every number as the server printed it (floats, NaN/Infinity and integers
    past 64 bits as orjson.Fragment of their text): ``orjson.dumps`` of the result writes them back
    byte for byte. (A float through Python prints ``-1.19e-07`` where pydantic-core and orjson
    printed ``-1.19e-7``.) Slower than orjson.loads: only for answers whose floats the harness
    gets (it asked for logprobs itself)."""
    return json.loads(raw, parse_float=orjson.Fragment, parse_int=_int_text, parse_constant=orjson.Fragment)


def dumps_faithful(raw: bytes, strip: Callable[[Any], Any]) -> bytes | None:
    """``raw`` (compact UTF-8 JSON, as pydantic, orjson and FastAPI write it) re-serialized after
    ``strip(obj)`` with every number's original text; None where that cannot be done (a lone
    surrogate orjson refuses: the caller falls back)."""
    try:
        obj = loads_faithful(raw)
        strip(obj)
        return orjson.dumps(obj)
    except (TypeError, ValueError, orjson.JSONEncodeError):
        return None


def json_style(raw: bytes) -> tuple[str, str, bool]:
    m = _FIRST_SEP.match(raw)
    kv = ":" + (m.group(2).decode() if m else "")
    spaced = m is not None and m.group(2) == b" "
    # (no substring pre-test: `b"\\u" in raw`, a two-byte find, is slower than this regex's
    # literal-prefix scan on a typical 300-byte event, 0.55 vs 0.33 us)
    return (", " if spaced else ",", kv, raw.isascii() and _HIGH_ESCAPE.search(raw) is not None)


def dumps_like(raw: bytes) -> Callable[[Any], bytes]:
    """A serializer that writes JSON the way ``raw`` was written: separators with or without
    spaces (json.dumps default vs compact) and non-ASCII kept or \\u-escaped. Servers differ
    (aiohttp's json_response uses json.dumps defaults, FastAPI and pydantic are compact), and a
    re-serialized answer should differ from the server's only where the proxy removed a field."""
    key = item, kv, ascii_only = json_style(raw)
    fn = _DUMPERS.get(key)
    if fn is None:
        def fn(obj: Any, _i=item, _k=kv, _a=ascii_only) -> bytes:
            return json.dumps(obj, ensure_ascii=_a, separators=(_i, _k), allow_nan=True).encode()
        _DUMPERS[key] = fn
    return fn


# Escapes a re-serializer writes differently than the server may have: every \uXXXX (a lone
# surrogate, a pair, an escaped non-ASCII or control character: orjson writes the character, or
# another spelling) and \/. Matched as backslash + the next character from the left, so an
# escaped backslash (\\) is consumed whole and never starts a false escape.
_ESCAPE = re.compile(rb"\\(?:u[0-9a-fA-F]{4}|.)", re.S)


def _mask_escapes(raw: bytes) -> tuple[bytes, bytes, list[bytes]] | None:
    """raw with each such escape replaced by a unique ASCII marker (which every serializer
    writes unchanged): (masked, marker prefix, the escapes in order); None when raw has none."""
    if b"\\u" not in raw and b"\\/" not in raw:
        return None
    prefix = b"polarEsc" + os.urandom(6).hex().encode()
    while prefix in raw:  # (a marker must never meet its own text in the server's bytes)
        prefix = b"polarEsc" + os.urandom(6).hex().encode()
    escapes: list[bytes] = []

    def mark(m: re.Match) -> bytes:
        esc = m.group(0)
        if esc[1:2] not in (b"u", b"/"):
            return esc  # \" \\ \n ...: every serializer writes these the same way
        escapes.append(esc)
        return b"%s_%d_" % (prefix, len(escapes) - 1)

    return _ESCAPE.sub(mark, raw), prefix, escapes


def _unmask(out: bytes, prefix: bytes, escapes: list[bytes]) -> bytes:
    return re.sub(re.escape(prefix) + rb"_(\d+)_", lambda m: escapes[int(m.group(1))], out)


def dumps_stripped(raw: bytes, strip: Callable[[Any], Any]) -> bytes | None:
    """``raw`` after ``strip(obj)``, byte for byte as the server wrote it everywhere else: its
    separators, each number's text, its non-ASCII characters raw or escaped as they were, and
    every string escape as written: a lone surrogate (``"\\ud83d"``, valid JSON that is no
    UTF-8), a pair, ``\\u00e9``, ``\\/``. The escapes are masked before parsing and put back
    after serializing, so no serializer's choice reaches the harness. None where it cannot be
    done (the caller falls back to ``dumps_like_safe``)."""
    masked = _mask_escapes(raw)
    text, prefix, escapes = masked if masked is not None else (raw, b"", [])
    item, kv, _ = json_style(text)
    try:
        if (item, kv) == (",", ":"):
            obj = loads_faithful(text)
            strip(obj)
            out = orjson.dumps(obj)
        else:  # a Python json.dumps server (spaced): its floats were Python's repr already
            obj = json.loads(text)
            strip(obj)
            out = json.dumps(obj, ensure_ascii=False, separators=(item, kv), allow_nan=True).encode()
    except (TypeError, ValueError, orjson.JSONEncodeError, UnicodeEncodeError):
        return None
    return _unmask(out, prefix, escapes) if escapes else out


def has_escapes(raw: bytes) -> bool:
    """Whether raw holds an escape that only ``dumps_stripped`` writes back as it was."""
    return b"\\u" in raw or b"\\/" in raw


def dumps_like_safe(raw: bytes, obj: Any) -> bytes:
    """``dumps_like(raw)(obj)``; where a lone surrogate (valid JSON, read by the json module)
    cannot be written as UTF-8, it is written escaped, as the server wrote it."""
    try:
        return dumps_like(raw)(obj)
    except UnicodeEncodeError:
        item, kv, _ = json_style(raw)
        return json.dumps(obj, ensure_ascii=True, separators=(item, kv), allow_nan=True).encode()
