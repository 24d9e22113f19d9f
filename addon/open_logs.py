"""Open episode logs of one proxy process: one EpisodeWriter per running episode, created on its
first call, closed when the episode ends (its end record makes the file read as finished).

In-flight calls: every call is counted from its request (``begin_call``) until its row is written
(``call_done``). ``POST /polar/<id>/end`` while calls of that episode are still in flight (a
stream still running) does not cut them off: the episode is marked *ending* (new calls to it are
refused), and the end record is written right after the last in-flight call's row, so the file
still ends with its end record and no completed call is lost.

Storage faults: a call whose row cannot be written is noted as lost (``record`` raises, the proxy
answers the harness 503): the writer puts an "incomplete" row in before its next row and the end
record says ``discard`` (polar_recon never builds the episode). Descriptors are bounded: at most
``max_open`` writers hold their file open; the least recently used are suspended (fd closed,
state kept) and reopen on their next row.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polar_contracts.episode_ids import episode_path
from polar_contracts.log.table import LogError
from polar_contracts.log.writer import EpisodeFinished, EpisodeWriter

# Recent call sequences a writer keeps to compress the next prompt against: agent loops extend
# the previous call, so a few suffice, and each can be ~100 KB of ids.
KEEP_RECENT = 4
MAX_OPEN = 128  # default bound on open log descriptors (option polar_max_open_logs)
MAX_EPISODES = 4096  # default bound on episodes open (started, not ended) at once (option polar_max_episodes)


class TooManyEpisodes(Exception):
    """A call or end for a new episode while ``max_episodes`` are open: refused before any file is made."""


class EpisodeEnding(EpisodeFinished):
    """A new call to an episode whose end was requested while calls were still in flight."""


@dataclass
class _Pending:
    reward: float | None
    metadata: dict[str, Any]
    # callbacks(calls_written) run at the end; callbacks(exception) when its record cannot be written
    waiters: list[Any] = field(default_factory=list)


class Episodes:
    def __init__(self, logdir: str | Path, fsync: bool = False, max_open: int = MAX_OPEN,
                 max_episodes: int = MAX_EPISODES):
        self.logdir = Path(logdir)
        self.fsync = fsync
        self.max_open = max(1, max_open)
        self.max_episodes = max(1, max_episodes)
        self._writers: dict[str, EpisodeWriter] = {}
        self._open: OrderedDict[str, None] = OrderedDict()  # episodes whose writer holds an fd, LRU
        self._lost: dict[str, list[tuple[int | None, str]]] = {}  # lost before a writer could open
        self._inflight: dict[str, int] = {}
        self._ending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def writer(self, episode_id: str) -> EpisodeWriter:
        """The open writer of an episode; raises EpisodeFinished if its log already ended."""
        with self._lock:
            return self._writer_locked(episode_id)

    def _writer_locked(self, episode_id: str) -> EpisodeWriter:
        w = self._writers.get(episode_id)
        if w is None or w.finished:
            if w is None and len(self._writers) >= self.max_episodes:
                raise TooManyEpisodes(f"{len(self._writers)} episodes are open on this proxy, the most it keeps "
                                      f"(option polar_max_episodes): episode {episode_id!r} is refused until some "
                                      f"end")
            self.logdir.mkdir(parents=True, exist_ok=True)
            w = EpisodeWriter(episode_path(self.logdir, episode_id), episode_id,
                              fsync=self.fsync, keep=KEEP_RECENT)  # (closes its fd if it fails)
            for idx, reason in self._lost.pop(episode_id, ()):
                w.note_lost(idx, reason)
            self._writers[episode_id] = w
        self._touch(episode_id)
        return w

    def _touch(self, episode_id: str) -> None:
        """The episode's writer holds (or is about to hold) an fd: most recently used; suspend
        the least recently used beyond max_open."""
        self._open[episode_id] = None
        self._open.move_to_end(episode_id)
        while len(self._open) > self.max_open:
            old, _ = self._open.popitem(last=False)
            w = self._writers.get(old)
            if w is not None:
                w.suspend()

    def record(self, episode_id: str, call_index: int, rows: list[dict[str, Any]]) -> None:
        """Write a call's rows. On a storage fault (OSError, LogError) the call is noted as lost
        (the episode becomes incomplete) and the error raised: the caller must not answer the
        call as a success."""
        try:
            with self._lock:
                w = self._writer_locked(episode_id)
            for row in rows:
                w.append_call(call_index=call_index, **row)
        except EpisodeFinished:
            raise
        except (OSError, LogError) as exc:
            self.note_lost(episode_id, call_index, f"call {call_index} could not be recorded ({exc}); "
                                                   f"the harness was answered with an error")
            raise

    def note_lost(self, episode_id: str, call_index: int | None, reason: str) -> None:
        with self._lock:
            w = self._writers.get(episode_id)
            if w is not None and not w.finished:
                w.note_lost(call_index, reason)
            else:
                self._lost.setdefault(episode_id, []).append((call_index, reason))

    def begin_call(self, episode_id: str) -> tuple[EpisodeWriter, int]:
        """A new call: (writer, call_index). Raises EpisodeFinished / EpisodeEnding."""
        with self._lock:
            if episode_id in self._ending:
                raise EpisodeEnding(f"episode {episode_id!r} is ending (its end was requested)")
            w = self._writer_locked(episode_id)
            self._inflight[episode_id] = self._inflight.get(episode_id, 0) + 1
            return w, w.next_call_index()

    def inflight(self, episode_id: str) -> int:
        with self._lock:
            return self._inflight.get(episode_id, 0)

    def call_done(self, episode_id: str) -> int | None:
        """The call's row is written (or given up). If it was the last in-flight call of an ending
        episode, writes the end record and returns the episode's call count; else None."""
        with self._lock:
            left = self._inflight.get(episode_id, 0) - 1
            if left > 0:
                self._inflight[episode_id] = left
                return None
            self._inflight.pop(episode_id, None)
            pending = self._ending.pop(episode_id, None)
        if pending is None:
            return None
        try:
            n = self._finish(episode_id, pending.reward, pending.metadata)
        except (OSError, LogError) as exc:
            # the end record is not on disk (a full disk): whoever waits on this end is told so,
            # never that it ended; the episode stays open, so the end can be sent again
            for cb in pending.waiters:
                cb(exc)
            raise
        for cb in pending.waiters:
            cb(n)
        return n

    def end(self, episode_id: str, reward: float | None, metadata: dict[str, Any],
            on_end: Any = None) -> int | None:
        """Write the end record now and return the number of calls logged; or, with calls still
        in flight, defer it to the last one's ``call_done`` and return None (``on_end(calls)`` is
        then called when it is written)."""
        with self._lock:
            if episode_id in self._ending:
                raise EpisodeEnding(f"episode {episode_id!r} is already ending")
            self._writer_locked(episode_id)  # raises EpisodeFinished if it already ended
            if self._inflight.get(episode_id, 0) > 0:
                self._ending[episode_id] = _Pending(reward, metadata, [on_end] if on_end else [])
                return None
        return self._finish(episode_id, reward, metadata)

    def _finish(self, episode_id: str, reward: float | None, metadata: dict[str, Any]) -> int:
        with self._lock:
            w = self._writer_locked(episode_id)
        calls = w.calls_written
        w.end(reward, metadata)  # (a storage fault raises here: the writer stays, the end can be retried)
        with self._lock:
            if self._writers.get(episode_id) is w:
                del self._writers[episode_id]
            self._open.pop(episode_id, None)
        return calls

    def close_all(self) -> None:
        """Shutdown: pending ends are written (their in-flight calls were cut off and logged with
        their error by now, or never will be); other episodes stay open for a later proxy."""
        with self._lock:
            pending, self._ending = dict(self._ending), {}
            self._inflight.clear()
        for eid, p in pending.items():
            try:
                n = self._finish(eid, p.reward, p.metadata)
            except (EpisodeFinished, OSError, LogError):
                continue
            for cb in p.waiters:
                cb(n)
        with self._lock:
            writers, self._writers = list(self._writers.values()), {}
            self._open.clear()
        for w in writers:
            try:
                w.close()
            except OSError:  # (a full disk refuses the end-of-stream marker: readers do without)
                pass


__all__ = ["Episodes", "EpisodeFinished", "EpisodeEnding", "TooManyEpisodes"]
