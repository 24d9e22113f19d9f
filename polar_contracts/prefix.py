"""Common prefixes and suffixes of token sequences and byte strings: one rule for the log writer's
prompt and request deltas, the proxy's prompt cache, the linker's parent search and polar-serve's
prefix cache."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix(a, b) -> int:
    """Length of the common prefix of two sequences: int arrays, bytes-like objects (bytes,
    memoryview: compared as bytes, without copies) or Python lists of ints.

    Compares in growing chunks, so an early mismatch is cheap and a long shared prefix (a
    harness's next prompt) costs one vectorized pass."""
    if isinstance(a, (bytes, bytearray, memoryview)):
        a, b = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    elif not isinstance(a, np.ndarray):
        return _list_prefix(a, b)
    n = min(len(a), len(b))
    pos, step = 0, 512
    while pos < n:
        end = min(n, pos + step)
        neq = np.flatnonzero(a[pos:end] != b[pos:end])
        if len(neq):
            return pos + int(neq[0])
        pos, step = end, step * 4
    return n


def _list_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    # Python lists: slices compared in blocks (a C memcmp-like loop), then item by item; converting
    # a 20k-id list to an array would cost more than the comparison.
    n = min(len(a), len(b))
    i, step = 0, 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_ends(a: bytes, b: bytes) -> tuple[int, int]:
    """(p, s): b shares its first p and its last s bytes with a, p + s <= min(len(a), len(b))."""
    if a == b:  # (a memcmp) a harness retrying, or a loop resending the same request
        return len(b), 0
    x, y = np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8)
    p = common_prefix(x, y)
    m = min(len(x), len(y)) - p  # the suffix may not overlap the prefix in either string
    return p, common_prefix(x[len(x) - m:][::-1], y[len(y) - m:][::-1]) if m > 0 else 0
