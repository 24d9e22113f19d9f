"""The contracts between Polar's parts: what one part writes and another reads, each defined once.

Every part imports this package; it imports none of them.

- ``log/``: the episode log (schema, the Arrow row encoder, writer, readers): the proxy writes it,
  reconstruction and people read it.
- ``shards``: the shard contract (columns, file names, terminations): reconstruction writes shards,
  the trainer and reports read them.
- ``sampling_fields``: the sampling columns' values and rules (log and shard).
- ``episode_ids``, ``weight_versions``: the two identifiers every row carries.
- ``control``: the proxy's control protocol (episode end, weight sync, hold/release): paths, bodies
  and their parsers, for the proxy that answers them and the rollout node and trainer that call.
- ``chat/``: how vLLM and SGLang render a chat request into a prompt (polar-serve serves with it,
  reconstruction re-renders with it).
- ``translate/``: the API translators (Responses, Messages <-> chat completions): the proxy runs
  them, reconstruction replays their request side.
- ``request_fields``, ``prefix``, ``assets``: small shared rules (lax request fields, common
  prefixes, where the bundled data is).

The names below are loaded on first use, so a process that imports only the writer (the capture
proxy) never imports polars.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "EpisodeLog": "log.reader", "read_episode": "log.reader", "read_log": "log.reader",
    "EpisodeWriter": "log.writer", "LogError": "log.table", "validate_episode_id": "episode_ids",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
