"""A model call's body, decompressed within its bound and measured (body_shape.py) before anything
parses it, off the event loop when it is large, one at a time per episode.

What one episode sends must not hold up another's calls. Inflating a compressed body and counting
a large one's values run in a worker thread (zlib and numpy release the GIL), so the event loop
that serves every episode goes on. Each episode has its own queue of such work: one body at a
time, and at most ``max_pending`` bytes waiting (beyond that the call is refused, 429), so an
episode sending bombs in a loop occupies one worker and its own queue, never the others'.
A small uncompressed body (under ``OFFLOAD_BYTES``) is not measured: any parse of it is cheap, and
the parsers bound its depth themselves (``BodyWork.read``).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from addon.body_shape import check_shape
from addon.bounded_decode import bounded_decode

OFFLOAD_BYTES = 256 * 1024  # an uncompressed body at least this large is measured in a worker thread
MAX_PENDING = 256 * 1024 * 1024  # default of polar_max_episode_pending_bytes


class EpisodeBusy(Exception):
    """The episode already has ``max_pending`` bytes of bodies waiting (the proxy answers 429)."""


@dataclass(frozen=True)
class BodyLimits:
    max_body: int  # decompressed bytes (polar_max_body)
    max_elements: int  # polar_max_json_elements
    max_depth: int  # polar_max_json_depth


def read_body(raw: bytes, encoding: str | None, limits: BodyLimits) -> bytes | None:
    """The decoded body (None when ``encoding`` is None: ``raw`` is it), measured. Raises
    BodyTooLarge / EncodingRefused (bounded_decode.py), ShapeRefused (body_shape.py). A body
    that does not decompress is returned as None unmeasured: the capture passes it through."""
    body = raw
    decoded = None
    if encoding is not None:
        try:
            body = decoded = bounded_decode(raw, encoding, limits.max_body)
        except ValueError:
            return None
    check_shape(body, limits.max_elements, limits.max_depth)
    return decoded


class BodyWork:
    """Each episode's queue of body work (module doc)."""

    def __init__(self, max_pending: int = MAX_PENDING) -> None:
        self.max_pending = max_pending
        self._pending: dict[str | None, int] = {}  # bytes waiting or in work, per episode
        self._locks: dict[str | None, asyncio.Lock] = {}

    def pending(self, episode_id: str | None) -> int:
        return self._pending.get(episode_id, 0)

    async def read(self, episode_id: str | None, raw: bytes, encoding: str | None, limits: BodyLimits) -> bytes | None:
        """read_body, inline for a small uncompressed body, else in a worker thread after the
        episode's earlier bodies; EpisodeBusy past the episode's byte budget."""
        if not raw or (encoding is None and len(raw) < OFFLOAD_BYTES):
            # Small and uncompressed: not measured (measuring 80 KB cost ~1.4x orjson's parse of it in
            # bench/bench_scale.py's profile). It cannot hold more values than it has bytes, and every
            # parser bounds the depth it reads (simdjson and orjson 1024; the json module's recursion
            # is answered 400 by the capture), at well under a millisecond for 256 KiB.
            return None
        before = self._pending.get(episode_id, 0)
        if before and before + len(raw) > self.max_pending:  # (one body alone is bounded by polar_max_body)
            raise EpisodeBusy(f"this episode already has {before} bytes of request bodies waiting to be read; this "
                              f"proxy queues at most {self.max_pending} per episode (option "
                              f"polar_max_episode_pending_bytes): send fewer calls at once")
        self._pending[episode_id] = before + len(raw)
        lock = self._locks.setdefault(episode_id, asyncio.Lock())
        try:
            async with lock:
                return await asyncio.to_thread(read_body, raw, encoding, limits)
        finally:
            left = self._pending[episode_id] - len(raw)
            if left:
                self._pending[episode_id] = left
            else:  # (nothing waits: the episode's entries go, so ended episodes cost nothing)
                del self._pending[episode_id]
                self._locks.pop(episode_id, None)
