"""Prompt id lists without re-parsing what an episode already sent (sans-IO).

A 20k-token prompt arrives as ~120 KB of JSON digits; turning it into 20k Python ints, then into a
4-byte array, then freeing the ints costs ~0.6 ms per call, on the harness's path. Agent loops
resend the previous prompt plus a few new turns, so the server's id list for call k+1 starts
with the same bytes as call k's. ``PromptCache.loads`` cuts the top-level (vLLM) or first choice's
(SGLang) ``prompt_token_ids`` list out of the raw answer, compares its bytes with the episode's
previous list, and parses only the new tail. The rest of the answer is parsed as usual.

Safety: the list is located by the byte pattern ``"prompt_token_ids":[`` (inside a JSON string a
quote is always escaped, so the pattern only matches a real key), replaced by a sentinel string,
and the parsed answer must have the sentinel exactly where the ids belong; anything else (two
lists, a nested key, odd spacing, not digits) falls back to parsing the whole answer.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any

import numpy as np
import orjson

from polar_contracts.prefix import common_prefix

from .jsonhead import int_list

# (pattern, key): vLLM's top-level / SGLang's per-choice prompt ids, and SGLang's streamed sglext
_KEYS = ((b'"prompt_token_ids":[', "prompt_token_ids"), (b'"prompt_token_ids": [', "prompt_token_ids"),
         (b'"input_ids":[', "input_ids"), (b'"input_ids": [', "input_ids"))
SENTINEL = "\x00polar-prompt-ids"
_SENTINEL_JSON = orjson.dumps(SENTINEL)
_DIGITS = b"0123456789, "
MIN_BYTES = 4096  # below this, parsing is cheap anyway


_BIG_TAIL = 2048  # bytes of digits past which simdjson parses the ids (no Python int per id)
_INT32_MAX = 2**31 - 1


def parse_ids(tail: bytes) -> array | None:
    """``1,2,3`` (the digits, commas and spaces between a list's brackets) as ``array('i')``;
    None if they are not a JSON list of int32 values."""
    if not tail.strip():
        return array("i")
    if len(tail) >= _BIG_TAIL:
        a = int_list(b"[" + tail + b"]")
        if a is not None:
            if len(a) and int(a.max()) > _INT32_MAX:
                return None
            out = array("i")
            out.frombytes(a.astype(np.intc).tobytes())  # (np.intc: the C int of array("i"))
            return out
    try:
        return array("i", orjson.loads(b"[" + tail + b"]"))
    except (orjson.JSONDecodeError, OverflowError, TypeError):
        return None


class PromptCache:
    """Per episode: the last prompt id list's bytes and ids (bounded, least recently used out)."""

    def __init__(self, max_episodes: int = 64):
        self.max = max_episodes
        self._last: OrderedDict[str, tuple[memoryview, array]] = OrderedDict()
        self.hits = 0  # ids reused from the previous list (for tests and the bench)

    def ids(self, key: str, raw: bytes, lo: int = 0, hi: int | None = None,
            extends: bool | None = None) -> array | None:
        """The ids of one list, ``raw[lo:hi]`` (the bytes between its brackets), or None if it is
        not a plain list of non-negative ints. The list is kept as a view into ``raw`` (no copy).
        ``extends``: whether it begins with the previous list, if the caller checked already."""
        hi = len(raw) if hi is None else hi
        span = memoryview(raw)[lo:hi]
        prev = self._last.get(key)
        reuse, tail_lo = 0, lo
        out = array("i")
        if prev is not None:
            pspan, pids = prev
            pn = len(pspan)
            if extends is None:
                extends = pn <= hi - lo and raw.startswith(pspan, lo)
            if extends and pn <= hi - lo:  # the common case: one memcmp
                if pn == hi - lo:  # the same list again
                    self._remember(key, span, pids)
                    self.hits += len(pids)
                    return pids
                if raw[lo + pn] == 0x2C:  # ",": the previous list's last number is complete here
                    reuse, tail_lo = len(pids), lo + pn + 1
            if reuse == 0:  # (the lists part earlier: a turn of the history changed)
                k = common_prefix(span, pspan)
                cut = raw.rfind(b",", lo, lo + k)  # numbers before this comma are complete and equal in both
                if cut > lo:
                    reuse = raw.count(b",", lo, cut) + 1
                    if reuse <= len(pids):
                        tail_lo = cut + 1
                    else:
                        reuse = 0
            if reuse:
                out = pids[:reuse]
        tail = raw[tail_lo:hi]
        if tail.translate(None, _DIGITS):
            return None
        new = parse_ids(tail)
        if new is None:
            return None
        out.extend(new)
        self.hits += reuse
        self._remember(key, span, out)
        return out

    def end_of_list(self, key: str, raw: bytes, lo: int) -> tuple[int, bool]:
        """Where the list starting at ``lo`` ends (its "]", or -1), and whether it begins with
        the episode's previous list (which holds no "]": the search starts after it)."""
        prev = self._last.get(key)
        if prev is not None and raw.startswith(prev[0], lo):
            return raw.find(b"]", lo + len(prev[0])), True
        return raw.find(b"]", lo), False

    def _remember(self, key: str, span: memoryview, ids: array) -> None:
        self._last[key] = (span, ids)
        self._last.move_to_end(key)
        while len(self._last) > self.max:
            self._last.popitem(last=False)

    def loads(self, key: str, raw: bytes) -> Any:
        """orjson.loads(raw), with the prompt id list (if any, and big) as an ``array('i')``
        taken from the cache where it can be. Raises orjson.JSONDecodeError like orjson.loads."""
        if len(raw) >= MIN_BYTES:
            for pat, field in _KEYS:
                start = raw.find(pat)
                if start < 0:
                    continue
                lo = start + len(pat)
                hi, extends = self.end_of_list(key, raw, lo)
                if hi < 0 or raw.find(pat, hi) >= 0 or hi - lo < MIN_BYTES:
                    break
                obj = self._spliced(key, raw, lo, hi, extends, field)
                if obj is not None:
                    return obj
                break
        return orjson.loads(raw)

    def _spliced(self, key: str, raw: bytes, lo: int, hi: int, extends: bool | None = None,
                 field: str = "prompt_token_ids") -> Any:
        try:
            obj = orjson.loads(raw[: lo - 1] + _SENTINEL_JSON + raw[hi + 1:])
        except orjson.JSONDecodeError:
            return None
        holder = _holder(obj, field)
        if holder is None:
            return None
        ids = self.ids(key, raw, lo, hi, extends)
        if ids is None:
            return None
        holder[field] = ids
        return obj


def _holder(obj: Any, field: str = "prompt_token_ids") -> dict | None:
    """The dict whose ``field`` is the sentinel: top level (vLLM), the one choice (SGLang), or
    the sglext of SGLang's streamed id chunk (``input_ids``)."""
    if not isinstance(obj, dict):
        return None
    if field == "input_ids":
        ext = obj.get("sglext")
        return ext if isinstance(ext, dict) and ext.get("input_ids") == SENTINEL else None
    if obj.get("prompt_token_ids") == SENTINEL:
        return obj
    choices = obj.get("choices")
    if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict) \
            and choices[0].get("prompt_token_ids") == SENTINEL:
        return choices[0]
    return None
