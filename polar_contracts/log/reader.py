"""The one reader of episode logs: `read_episode` and `read_log` (polars frames, full prompts).

The pyarrow-level reading lives in log/table.py (the proxy's writer shares it and never loads polars).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa

from polar_contracts.auxiliary import AuxiliaryRuleError, first_match, rules_from_metadata
from polar_contracts.episode_ids import episode_id_of
from polar_contracts.log.schema import KIND_CALL, KIND_END, READ_DROP, SCHEMA
from polar_contracts.log.table import LogError, _full_prompts, full_requests, read_batches, unpack


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
    path = Path(path)
    if not path.exists():
        raise LogError(f"{path}: no such log")
    batches, _, torn, _ = read_batches(path)
    table = pa.Table.from_batches(batches, schema=SCHEMA) if batches else SCHEMA.empty_table()
    kinds = table.column("kind").to_pylist()
    end_rows = [i for i, k in enumerate(kinds) if k == KIND_END]
    reward = None
    metadata: dict[str, Any] = {}
    if end_rows:
        last = end_rows[-1]
        reward = table.column("reward")[last].as_py()
        meta = table.column("metadata")[last].as_py()
        metadata = json.loads(meta) if meta else {}
    call_mask = pa.array([k == KIND_CALL for k in kinds], type=pa.bool_())
    calls = table.filter(call_mask) if len(kinds) else table
    try:
        prompts = _full_prompts(calls)
        requests = full_requests(calls)
    except LogError as exc:
        raise LogError(f"{path}: {exc}") from exc
    responses = [None if b is None else unpack(b).decode() for b in calls.column("response_zstd").to_pylist()]
    try:
        rules = rules_from_metadata(metadata, str(path))
    except AuxiliaryRuleError as exc:
        raise LogError(str(exc)) from exc
    if rules:  # the recipe's auxiliary rules (auxiliary.py), applied as log/arrays.py applies them
        aux = calls.column("auxiliary").to_pylist()
        apis = calls.column("api").to_pylist()
        flags = [bool(a) or first_match(rules, api, req) is not None for a, api, req in zip(aux, apis, requests, strict=True)]
        calls = calls.set_column(calls.schema.get_field_index("auxiliary"), "auxiliary", pa.array(flags, pa.bool_()))
    calls = calls.drop_columns(list(READ_DROP))
    calls = calls.append_column("request", pa.array(requests, type=pa.string()))
    calls = calls.append_column("response", pa.array(responses, type=pa.string()))
    calls = calls.append_column(
        pa.field("prompt_ids", pa.list_(pa.int32())), pa.array(prompts, type=pa.list_(pa.int32()))
    )
    df = pl.from_arrow(calls)
    assert isinstance(df, pl.DataFrame)
    df = df.sort(["call_index", "choice"], maintain_order=True, nulls_last=True)
    return EpisodeLog(path, episode_id_of(path), df, bool(end_rows), reward, metadata, torn)


def read_log(path: str | os.PathLike) -> pl.DataFrame:
    """The calls of one episode log as a polars DataFrame with full ``prompt_ids``."""
    return read_episode(path).calls
