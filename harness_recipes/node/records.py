"""The rollout's own record of every episode: OUT/rollout/episodes.jsonl, one JSON line per finish.

Append-only and flushed per line, so a run killed at any point keeps what it finished; the last
line for a (task, sample) wins. A restarted run skips samples whose last status is terminal and
retries the others under a new attempt id (a fresh episode log, never appended to a dead one).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from harness_recipes.node.episode import TERMINAL


class Records:
    def __init__(self, outdir: Path):
        self.dir = outdir / "rollout"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "episodes.jsonl"
        self._lock = threading.Lock()
        self.latest: dict[tuple[str, int], dict] = {}
        self.attempts: dict[tuple[str, int], int] = {}
        self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
                key = (rec["task_id"], int(rec["sample"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                # A torn last line from a killed run: ignore it, the episode simply runs again.
                continue
            self.latest[key] = rec
            self.attempts[key] = max(self.attempts.get(key, 0), int(rec.get("attempt", 0)) + 1)

    def finished(self, task_id: str, sample: int) -> bool:
        rec = self.latest.get((task_id, sample))
        return rec is not None and rec.get("status") in TERMINAL

    def next_attempt(self, task_id: str, sample: int) -> int:
        return self.attempts.get((task_id, sample), 0)

    def append(self, rec: dict) -> None:
        line = json.dumps(rec, sort_keys=True) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        key = (rec["task_id"], int(rec["sample"]))
        self.latest[key] = rec
        self.attempts[key] = max(self.attempts.get(key, 0), int(rec.get("attempt", 0)) + 1)

    def episode_dir(self, eid: str) -> Path:
        return self.dir / eid

    @property
    def logs(self) -> Path:
        """OUT/rollout/logs: this run's episode logs (links to LOGDIR's), what `--recon` builds and
        `polar-recon compare OUT` reads; never the logs other runs wrote into the same proxy logdir."""
        return self.dir / "logs"

    def link_log(self, log: Path) -> None:
        """Add one episode's capture log to ``logs``: a hard link (the same file, complete once the
        proxy ended it), a symbolic link across filesystems."""
        self.logs.mkdir(exist_ok=True)
        dest = self.logs / log.name
        if dest.exists() or dest.is_symlink():
            return
        try:
            os.link(log, dest)
        except OSError:
            dest.symlink_to(log.resolve())
