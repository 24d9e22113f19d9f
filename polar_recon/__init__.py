"""Token-faithful reconstruction of training sequences from Polar episode logs; the base package.

Everything the other parts share lives here: the episode log format (logschema, logtable, the
writer logwriter, the reader logreader), the episode id rule (episode_ids), the shard contract
(shards), the chat rendering rules the servers apply (chat_render) and the bundled data (assets).

The names below are loaded on first use, so a process that imports only the writer (the capture
proxy) never imports polars.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EpisodeLog": "logreader", "read_episode": "logreader", "read_log": "logreader",
    "EpisodeWriter": "logwriter", "LogError": "logtable", "validate_episode_id": "episode_ids",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
