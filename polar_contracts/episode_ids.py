"""The episode id rule, in one place: what an id may be, where its log lives, and the id of a log.

An id becomes a file name in LOGDIR, so it is validated before it reaches any path: ASCII letters,
digits, ``.``, ``_`` and ``-``, 1 to 128 of them, and neither ``.`` nor ``..``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

EPISODE_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
EPISODE_ID_RULE = "[A-Za-z0-9._-]{1,128}, not '.' or '..'"
LOG_SUFFIX = ".arrow"


def is_valid_episode_id(episode_id: object) -> bool:
    return isinstance(episode_id, str) and bool(EPISODE_ID_RE.match(episode_id)) and episode_id not in (".", "..")


def validate_episode_id(episode_id: str, source: str | None = None) -> str:
    """Return the id if it is safe as a file name in LOGDIR, else raise ValueError naming it
    (and where it came from, when `source` says)."""
    if not is_valid_episode_id(episode_id):
        shown = episode_id if not isinstance(episode_id, str) or len(episode_id) <= 80 else episode_id[:80] + "..."
        where = f" (from {source})" if source else ""
        raise ValueError(f"invalid episode id {shown!r}{where}: it must match {EPISODE_ID_RULE}")
    return episode_id


def episode_path(logdir: str | os.PathLike, episode_id: str) -> Path:
    """LOGDIR/<episode_id>.arrow, for a validated id."""
    return Path(logdir) / f"{validate_episode_id(episode_id)}{LOG_SUFFIX}"


def episode_id_of(path: str | os.PathLike) -> str:
    """The episode id a log file's name carries (LOGDIR/<episode_id>.arrow)."""
    name = Path(path).name
    return name[: -len(LOG_SUFFIX)] if name.endswith(LOG_SUFFIX) else Path(name).stem


def is_log_file(path: Path) -> bool:
    return path.name.endswith(LOG_SUFFIX) and path.is_file()
