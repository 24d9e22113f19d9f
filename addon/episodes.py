"""Open episode logs of one proxy process: one EpisodeWriter per running episode, created on its
first call, closed when the episode ends (its end record makes the file read as finished)."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from polar_recon.logfile import EpisodeFinished, EpisodeWriter, episode_path

# Recent call sequences a writer keeps to compress the next prompt against: agent loops extend
# the previous call, so a few suffice, and each can be ~100 KB of ids.
KEEP_RECENT = 4


class Episodes:
    def __init__(self, logdir: str | Path, fsync: bool = False):
        self.logdir = Path(logdir)
        self.fsync = fsync
        self._writers: dict[str, EpisodeWriter] = {}
        self._lock = threading.Lock()

    def writer(self, episode_id: str) -> EpisodeWriter:
        """The open writer of an episode; raises EpisodeFinished if its log already ended."""
        with self._lock:
            w = self._writers.get(episode_id)
            if w is None or w.finished:
                self.logdir.mkdir(parents=True, exist_ok=True)
                w = EpisodeWriter(episode_path(self.logdir, episode_id), episode_id,
                                  fsync=self.fsync, keep=KEEP_RECENT)
                self._writers[episode_id] = w
            return w

    def end(self, episode_id: str, reward: float | None, metadata: dict[str, Any]) -> int:
        """Write the end record; returns the number of calls the episode logged."""
        w = self.writer(episode_id)
        with self._lock:
            self._writers.pop(episode_id, None)
        calls = w.calls_written
        w.end(reward, metadata)
        return calls

    def close_all(self) -> None:
        with self._lock:
            writers, self._writers = list(self._writers.values()), {}
        for w in writers:
            w.close()


__all__ = ["Episodes", "EpisodeFinished"]
