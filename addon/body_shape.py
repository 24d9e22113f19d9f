"""A model call's JSON body measured before anything parses it: how many values it can hold and
how deeply it nests (sans-IO).

Parsing is the cost an episode can aim at its siblings: every parser here (simdjson, orjson, the
json module) runs under the GIL, on the event loop that serves every episode. A 45 KiB gzip body
that inflates to 45 MiB of ``{},{},...`` is 16M objects: orjson took 4.5 s and 2 GiB building them
(a repeated key sends the body past simdjson's fast read), and every other episode's call waited.
JSON nested a few thousand levels deep made the json module raise RecursionError (a 500 and a
traceback). So a body is refused (400) before any parse when it could hold more than
``polar_max_json_elements`` values or nests deeper than ``polar_max_json_depth`` levels.

Both measures run in numpy, a chunk at a time: numpy releases the GIL in its loops, so the proxy
runs them in a worker thread (body_work.py) and the event loop goes on meanwhile. Only compressed
and large bodies are measured: a small one is cheap to parse whatever it holds (body_work.py).

- ``element_bound``: the commas and opening brackets, +1. Every value past a container's first
  is preceded by a comma and every container opens with a bracket, so this is an upper bound on
  the values a parser builds (those inside strings counted too: it only ever over-counts).
- ``json_depth``: the nesting depth outside strings, exact for valid JSON (a string's quote
  escaped by an odd run of backslashes does not end it); the scan stops as soon as the depth
  passes the bound asked.
"""
from __future__ import annotations

import numpy as np

MAX_JSON_ELEMENTS = 1_000_000  # default of polar_max_json_elements: a 1M-token id list (orjson: ~50 ms)
MAX_JSON_DEPTH = 128  # default of polar_max_json_depth: tool schemas nest ~10-20 levels
CHUNK = 1 << 20  # bytes scanned per numpy pass (bounds the scan's temporary arrays to a few MB)

_QUOTE, _BACKSLASH, _COMMA = 0x22, 0x5C, 0x2C
_OPENS, _CLOSES = (0x5B, 0x7B), (0x5D, 0x7D)  # [ {   ] }


class ShapeRefused(Exception):
    """The body could hold too many values or nests too deeply: the proxy answers 400, with this
    message, and nothing parses it."""


def element_bound(raw: bytes) -> int:
    """An upper bound on the number of JSON values in ``raw`` (module doc)."""
    a = np.frombuffer(raw, np.uint8)
    n = 1
    for i in range(0, len(a), CHUNK):
        c = a[i:i + CHUNK]
        n += sum(int(np.count_nonzero(c == b)) for b in (_COMMA, *_OPENS))
    return n


def json_depth(raw: bytes, stop_above: int | None = None) -> int:
    """The nesting depth of ``raw`` outside strings; with ``stop_above``, a value past it as soon
    as the scan finds one (the rest is not read). Works on the few bytes that matter (quotes,
    backslashes, brackets: a few thousand in an 80 KB agent request), a chunk at a time."""
    a = np.frombuffer(raw, np.uint8)
    in_str = False  # whether the chunk starts inside a string
    run = 0  # backslashes that end the previous chunk (they may escape this chunk's first quote)
    depth = deepest = 0
    for i in range(0, len(a), CHUNK):
        c = a[i:i + CHUNK]
        mask = c == _QUOTE
        for b in (_BACKSLASH, *_OPENS, *_CLOSES):
            mask |= c == b
        pos = np.flatnonzero(mask)
        v = c[pos]
        m = len(pos)
        if m:
            is_bs = v == _BACKSLASH
            adjacent = np.zeros(m, bool)  # the element before is a backslash right before this byte
            adjacent[1:] = is_bs[:-1] & (np.diff(pos) == 1)
            # each backslash run's length at its last element: elements since the run's start
            k = np.arange(m)
            start = np.maximum.accumulate(np.where(adjacent & is_bs, 0, k))
            runlen = k - start + 1
            if run and pos[0] == 0 and is_bs[0]:  # the run began in the last chunk
                runlen[start == 0] += run
            escaped = np.zeros(m, bool)
            escaped[1:] = adjacent[1:] & (runlen[:-1] & 1 == 1)
            if run & 1 and pos[0] == 0:
                escaped[0] = True
            real = (v == _QUOTE) & ~escaped
            # inside a string: an odd number of real quotes up to here (with the carry)
            inside = (np.cumsum(real) & 1).astype(bool) ^ in_str
            step = (v == _OPENS[0]) | (v == _OPENS[1])
            step = step.astype(np.int64) - ((v == _CLOSES[0]) | (v == _CLOSES[1]))
            step[inside] = 0
            levels = depth + np.cumsum(step)
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
            in_str ^= bool(int(np.count_nonzero(real)) & 1)
        kept = len(raw[i:i + CHUNK].rstrip(b"\\"))
        run = len(c) - kept + (run if kept == 0 else 0)
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def check_shape(raw: bytes, max_elements: int, max_depth: int) -> None:
    """Raise ShapeRefused when ``raw`` could hold more than ``max_elements`` values or nests deeper
    than ``max_depth`` (names the option to raise)."""
    n = element_bound(raw)
    if n > max_elements:
        raise ShapeRefused(f"request body could hold up to {n} JSON values (commas and brackets counted); this proxy "
                           f"parses at most {max_elements} (option polar_max_json_elements)")
    if n <= max_depth:  # (fewer brackets than levels allowed: no need to scan)
        return
    d = json_depth(raw, max_depth)
    if d > max_depth:
        raise ShapeRefused(f"request body nests JSON more than {max_depth} levels deep; this proxy accepts at most "
                           f"{max_depth} (option polar_max_json_depth)")
