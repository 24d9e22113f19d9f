"""`read_episode` and `read_log`: an episode log as a polars frame with full prompts, for people.

A view over the one decode (log/arrays.py `decode_log`): the same call rows, prompts, requests,
auxiliary flags and end record that reconstruction reads, as one polars frame. The pyarrow-level
reading lives in log/table.py (the proxy's writer shares it and never loads polars).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from polar_contracts.episode_ids import episode_id_of
from polar_contracts.log.arrays import decode_log
from polar_contracts.log.schema import READ_DROP
from polar_contracts.log.table import LogError, unpack

__all__ = ["EpisodeLog", "LogError", "read_episode", "read_log"]


@dataclass
class EpisodeLog:
    path: Path
    episode_id: str
    calls: pl.DataFrame  # one row per call (per choice), full prompt_ids, sorted by call_index
    finished: bool  # an end record is on disk
    reward: float | None
    metadata: dict[str, Any]
    truncated: bool  # a torn last batch was found (writer killed mid-write)


def read_episode(path: str | os.PathLike) -> EpisodeLog:
    """One episode log: its calls as a polars frame and its end record. Raises LogError naming the file."""
    log = decode_log(path)
    calls = log.calls
    if any(r is not None for r in log.auxiliary_rules):  # the recipe's rules (auxiliary.py), as decoded
        flags = [bool(a) or r is not None for a, r in zip(calls.column("auxiliary").to_pylist(), log.auxiliary_rules,
                                                          strict=True)]
        calls = calls.set_column(calls.schema.get_field_index("auxiliary"), "auxiliary", pa.array(flags, pa.bool_()))
    try:
        responses = [None if b is None else unpack(b).decode() for b in calls.column("response_zstd").to_pylist()]
    except (LogError, UnicodeDecodeError, pa.ArrowException) as exc:
        raise LogError(f"{log.path}: a response payload cannot be read ({exc})") from exc
    prompts = [None if s is None else s[:n].tolist() for s, n in zip(log.seqs, log.prompt_lens, strict=True)]
    calls = calls.drop_columns(list(READ_DROP))
    calls = calls.append_column("request", pa.array(log.requests, type=pa.string()))
    calls = calls.append_column("response", pa.array(responses, type=pa.string()))
    calls = calls.append_column(
        pa.field("prompt_ids", pa.list_(pa.int32())), pa.array(prompts, type=pa.list_(pa.int32()))
    )
    df = pl.from_arrow(calls)
    assert isinstance(df, pl.DataFrame)
    df = df.sort(["call_index", "choice"], maintain_order=True, nulls_last=True)
    end = log.end
    return EpisodeLog(log.path, episode_id_of(log.path), df, end.finished, end.reward, end.metadata, log.torn)


def read_log(path: str | os.PathLike) -> pl.DataFrame:
    """The calls of one episode log as a polars DataFrame with full ``prompt_ids``."""
    return read_episode(path).calls
