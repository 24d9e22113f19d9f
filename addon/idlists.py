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

_KEYS = (b'"prompt_token_ids":[', b'"prompt_token_ids": [')
SENTINEL = "\x00polar-prompt-ids"
_SENTINEL_JSON = orjson.dumps(SENTINEL)
_DIGITS = b"0123456789, "
MIN_BYTES = 4096  # below this, parsing is cheap anyway


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    if (b.startswith(a) if len(a) <= len(b) else a.startswith(b)):  # a memcmp, no 120 KB slice copies
        return n
    x = np.frombuffer(a, dtype=np.uint8, count=n)
    y = np.frombuffer(b, dtype=np.uint8, count=n)
    return int(np.flatnonzero(x != y)[0])


class PromptCache:
    """Per episode: the last prompt id list's bytes and ids (bounded, least recently used out)."""

    def __init__(self, max_episodes: int = 64):
        self.max = max_episodes
        self._last: OrderedDict[str, tuple[bytes, array]] = OrderedDict()
        self.hits = 0  # ids reused from the previous list (for tests and the bench)

    def ids(self, key: str, span: bytes) -> array | None:
        """The ids of one list (the bytes between its brackets), or None if it is not a plain
        list of non-negative ints."""
        prev = self._last.get(key)
        reuse = 0
        out = array("i")
        if prev is not None:
            pspan, pids = prev
            k = _common_prefix(span, pspan)
            if k == len(span) == len(pspan):
                self._remember(key, span, pids)
                self.hits += len(pids)
                return pids
            cut = span.rfind(b",", 0, k)  # numbers before this comma are complete and equal in both
            if cut > 0:
                reuse = span.count(b",", 0, cut) + 1
                if reuse <= len(pids):
                    out = pids[:reuse]
                    span_tail = span[cut + 1:]
                else:
                    reuse = 0
        if reuse == 0:
            span_tail = span
        if span_tail.translate(None, _DIGITS):
            return None
        try:
            tail = orjson.loads(b"[" + span_tail + b"]") if span_tail.strip() else []
            out.extend(tail)
        except (orjson.JSONDecodeError, OverflowError, TypeError):
            return None
        self.hits += reuse
        self._remember(key, span, out)
        return out

    def _remember(self, key: str, span: bytes, ids: array) -> None:
        self._last[key] = (span, ids)
        self._last.move_to_end(key)
        while len(self._last) > self.max:
            self._last.popitem(last=False)

    def loads(self, key: str, raw: bytes) -> Any:
        """orjson.loads(raw), with the prompt id list (if any, and big) as an ``array('i')``
        taken from the cache where it can be. Raises orjson.JSONDecodeError like orjson.loads."""
        if len(raw) >= MIN_BYTES:
            for pat in _KEYS:
                start = raw.find(pat)
                if start < 0:
                    continue
                lo = start + len(pat)
                hi = raw.find(b"]", lo)
                if hi < 0 or raw.find(pat, hi) >= 0 or hi - lo < MIN_BYTES:
                    break
                obj = self._spliced(key, raw, lo, hi)
                if obj is not None:
                    return obj
                break
        return orjson.loads(raw)

    def _spliced(self, key: str, raw: bytes, lo: int, hi: int) -> Any:
        try:
            obj = orjson.loads(raw[: lo - 1] + _SENTINEL_JSON + raw[hi + 1:])
        except orjson.JSONDecodeError:
            return None
        holder = _holder(obj)
        if holder is None:
            return None
        ids = self.ids(key, raw[lo:hi])
        if ids is None:
            return None
        holder["prompt_token_ids"] = ids
        return obj


def _holder(obj: Any) -> dict | None:
    """The dict whose prompt_token_ids is the sentinel: top level (vLLM) or the one choice (SGLang)."""
    if not isinstance(obj, dict):
        return None
    if obj.get("prompt_token_ids") == SENTINEL:
        return obj
    choices = obj.get("choices")
    if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict) \
            and choices[0].get("prompt_token_ids") == SENTINEL:
        return choices[0]
    return None
