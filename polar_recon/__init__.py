"""Token-faithful reconstruction of training sequences from Polar episode logs.

``polar-recon build LOGDIR OUT`` (cli.py): read each episode log, link its calls into sequences
(strategies.py, link.py, rerender.py, fidelity.py), write shards (shard_writer.py); ``drift``,
``show`` and the HTML view report on them. The log and shard formats themselves are contracts and
live in polar_contracts; ``polar_recon.read_log`` and the other names below are the same objects,
kept here because users and tools know them by these names.
"""
from __future__ import annotations

import importlib

_EXPORTS = ("EpisodeLog", "read_episode", "read_log", "EpisodeWriter", "LogError", "validate_episode_id")
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module("polar_contracts"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
