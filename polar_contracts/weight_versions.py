"""Weight-version values that are NOT one version, in one place (the proxy writes them, recon
passes them through, the trainer reads them).

A ``weight_version`` is an opaque string naming the policy that served a call: polar-serve's
reload counter (``"0"``, ``"1"``, ...), SGLang's and vLLM's ``"default"`` at startup, then whatever
the weight sync named it (the trainer's ``step-000012``). Two marked values say that no single
version served the call, and must never be read as one:

- ``spans:["A","B"]`` (the prefix, then a JSON list): the call was in flight while the server
  loaded new weights (the proxy's drain timed out), so its tokens may come from A and from B.
- ``unknown:<reason>``: the proxy cannot name the weights, e.g. after a sync that failed midway on
  a server whose load is not atomic (real vLLM's in-place reload), until the next good sync.

Versions a sync names may not start with either prefix (``check_version``).

One more kind of value names one version, the proxy's own: ``proxy:<start>-<n>`` (``proxy_version``).
A server that reports no version (stock vLLM without ``VLLM_SERVER_DEV_MODE=1``, whose
``/weight_info`` is a dev route) gets it from the proxy: ``<start>`` is the proxy process's start
(UTC time and pid), ``<n>`` the successful syncs through it so far. So every row names a version from
the first call; the trainer orders it by its sync history like any other, and one it never learned
(another proxy's, or the trainer never asked) as the oldest, as it did a null.
"""
from __future__ import annotations

import json
import re

SPAN_PREFIX = "spans:"
UNKNOWN_PREFIX = "unknown:"
# What a version named by a sync may be: printable, no whitespace, bounded, not a marker.
VERSION_RE = re.compile(r"^[A-Za-z0-9._:+-]{1,128}$")


PROXY_PREFIX = "proxy:"


def proxy_version(start: str, syncs: int) -> str:
    """The proxy's name for the weights a server serves when the server names none (module doc)."""
    return f"{PROXY_PREFIX}{start}-{syncs}"


def is_proxy_version(v: str | None) -> bool:
    return v is not None and v.startswith(PROXY_PREFIX)


def spanning(old: str | None, new: str | None) -> str:
    """The marker of a call that was in flight while the weights changed from ``old`` to ``new``."""
    return SPAN_PREFIX + json.dumps([old, new], separators=(",", ":"))


def unknown(reason: str) -> str:
    return UNKNOWN_PREFIX + reason


def spans_of(v: str | None) -> list[str | None] | None:
    """The versions a ``spans:`` marker names, else None."""
    if v is None or not v.startswith(SPAN_PREFIX):
        return None
    try:
        out = json.loads(v[len(SPAN_PREFIX):])
    except ValueError:
        return [None]
    return out if isinstance(out, list) else [None]


def is_marker(v: str | None) -> bool:
    """True for a value that does not name one version (spans or unknown)."""
    return v is not None and v.startswith((SPAN_PREFIX, UNKNOWN_PREFIX))


def check_version(v: object, what: str = "version") -> str:
    """A version a weight sync may name; ValueError naming the problem otherwise."""
    if not isinstance(v, str) or not VERSION_RE.match(v) or is_marker(v):
        raise ValueError(f"{what} must be a string matching {VERSION_RE.pattern} and not start with "
                         f"{SPAN_PREFIX!r} or {UNKNOWN_PREFIX!r}, not {v!r}")
    return v
