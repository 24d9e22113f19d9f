"""The column-wise reads behind `polar-recon compare`: shard rows, rollout records, log calls, each
as one polars frame with a ``harness`` column (the source's name). No per-row Python: shards are
scanned lazily (only the columns the report needs; token counts as list lengths and sums in
polars), records parse as one NDJSON buffer, a log's prompt lengths come from its on-disk
columns (prompt_base_len + the packed tail's 4-byte raw length), never by decompressing prompts.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from polar_contracts.log import end_record as end
from polar_contracts.log.end_record import end_record_of
from polar_contracts.log.schema import KIND_CALL, KIND_END
from polar_contracts.log.table import LogError, read_table

from .sources import Source

# The shard columns read (besides loss_mask, reduced to its length and sum at scan time); those a
# shard of an older build may lack read as null.
SHARD_COLS = {"episode_id": pl.String, "group_id": pl.String, "segment": pl.Int32, "reward": pl.Float64,
              "n_calls": pl.Int32, "n_realign": pl.Int32, "weight_version": pl.String, "realign_tokens": pl.Int32,
              "realign_classes": pl.List(pl.String), "termination": pl.String}
PHASES = ("prewarm", "run", "eval", "recon")  # harness_recipes/node/scheduler.py's phase names
RECORD_SCHEMA = {"episode_id": pl.String, "harness": pl.String, "status": pl.String, "reward": pl.Float64,
                 "n_calls": pl.Int64, "error": pl.String, "finished_at": pl.Float64,
                 "phases": pl.Struct({p: pl.List(pl.Float64) for p in PHASES})}
LOG_COLS = ["kind", "episode_id", "call_index", "status", "error", "auxiliary", "t_start", "t_first_byte", "t_end",
            "prompt_base_len", "prompt_tail_zstd", "completion_ids", "reward", "metadata"]


class ShardError(ValueError):
    """A shard that cannot be read as one (not Parquet, no episode_id column); names the file."""


def _schema_names(path: Path) -> frozenset[str]:
    try:
        return frozenset(pq.read_schema(path).names)  # the footer only
    except (OSError, pa.ArrowInvalid) as exc:
        raise ShardError(f"{path}: not a readable Parquet shard ({exc})") from None


def _scan(paths: list[Path], have: frozenset[str]) -> pl.LazyFrame:
    """One scan over shards of one schema (older builds lack the fidelity / sampling columns: null)."""
    missing = [c for c in ("episode_id", "input_ids", "loss_mask", "reward") if c not in have]
    if missing:
        raise ShardError(f"{paths[0]}: not a Polar shard (no {', '.join(missing)} column)")
    cols = [pl.col(c) if c in have else pl.lit(None, t).alias(c) for c, t in SHARD_COLS.items()]
    # tokens from loss_mask's lengths: the same as input_ids' (the shard contract), and int8 lists
    # decode at a quarter of the int32 ids' bytes, so input_ids is never read
    return pl.scan_parquet(paths).select(*cols, pl.col("loss_mask").list.len().cast(pl.Int64).alias("tokens"),
                                         pl.col("loss_mask").list.sum().cast(pl.Int64).alias("trainable"))


def shard_rows(sources: list[Source]) -> pl.DataFrame:
    """One row per shard row: the SHARD_COLS, tokens, trainable, harness. One lazy scan per source
    and schema, not one per file: polars plans and parallelizes the whole list at once (a scan per
    file, hundreds of them collected together, exhausts polars' blocking-thread pool)."""
    frames = []
    for s in sources:
        groups: dict[frozenset[str], list[Path]] = {}
        for p in s.shards:
            groups.setdefault(_schema_names(p), []).append(p)
        frames += [_scan(ps, have).with_columns(pl.lit(s.name).alias("harness")) for have, ps in groups.items()]
    if not frames:
        return pl.DataFrame(schema={**SHARD_COLS, "tokens": pl.Int64, "trainable": pl.Int64, "harness": pl.String})
    return pl.concat(frames).collect()


def records(sources: list[Source]) -> pl.DataFrame:
    """The rollout's record of each episode (the last one written per episode id: a retried attempt
    has its own id), with each phase's seconds (prewarm_s, run_s, eval_s, recon_s)."""
    parts = []
    for s in sources:
        buf = io.BytesIO()
        for p in s.records:
            data = p.read_bytes()
            if p.suffix == ".jsonl":
                # appended and flushed per line: a run killed mid-write leaves a torn last line with
                # no newline (node/records.py ignores it too)
                data = data[:data.rfind(b"\n") + 1]
            data = data.strip()
            if data:
                buf.write(data + b"\n")  # a record JSON (fleet store) is one object on one line
        if not buf.tell():
            continue
        buf.seek(0)
        try:
            df = pl.read_ndjson(buf, schema=RECORD_SCHEMA, ignore_errors=True)
        except pl.exceptions.PolarsError as exc:
            raise ValueError(f"{s.root}: rollout records are not JSON lines ({exc})") from None
        parts.append(df.with_columns(pl.lit(s.name).alias("source")))
    if not parts:
        return pl.DataFrame(schema={**RECORD_SCHEMA, "source": pl.String,
                                    **{f"{p}_s": pl.Float64 for p in PHASES}}).drop("phases")
    df = pl.concat(parts).filter(pl.col("episode_id").is_not_null()).unique("episode_id", keep="last",
                                                                             maintain_order=True)
    return df.with_columns(
        [(pl.col("phases").struct.field(p).list.get(1, null_on_oob=True)
          - pl.col("phases").struct.field(p).list.get(0, null_on_oob=True)).alias(f"{p}_s") for p in PHASES]
    ).drop("phases")


def _prompt_lens(table: pa.Table) -> np.ndarray:
    """Each row's full prompt length from the on-disk columns: the shared base plus the packed
    tail's raw byte length / 4 (schema.py: 4-byte little-endian length, then zstd), NaN: no prompt."""
    tail = table.column("prompt_tail_zstd").combine_chunks()
    n = len(tail)
    out = np.full(n, np.nan)
    if n == 0:
        return out
    valid = ~np.asarray(tail.is_null().to_numpy(zero_copy_only=False))
    offsets = np.frombuffer(tail.buffers()[1], dtype=np.int32, count=n + 1, offset=tail.offset * 4)
    data = np.frombuffer(tail.buffers()[2], dtype=np.uint8) if tail.buffers()[2] is not None else np.zeros(0, np.uint8)
    starts = offsets[:-1][valid]
    raw = (data[starts[:, None] + np.arange(4)].astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32))).sum(1)
    base = table.column("prompt_base_len").to_numpy(zero_copy_only=False)
    out[valid] = base[valid] + raw // 4
    return out


def _log_frame(path: Path) -> pa.Table:
    table, _torn = read_table(path, LOG_COLS)
    end_record_of(table, path)  # an end record that is not a JSON object: a LogError naming the file
    comp = table.column("completion_ids")
    import pyarrow.compute as pc

    return pa.table({
        "episode_id": table.column("episode_id"), "kind": table.column("kind"),
        "call_index": table.column("call_index"), "status": table.column("status"), "error": table.column("error"),
        "auxiliary": table.column("auxiliary"), "t_start": table.column("t_start"),
        "t_first_byte": table.column("t_first_byte"), "t_end": table.column("t_end"),
        "prompt_len": pa.array(_prompt_lens(table), pa.float64(), from_pandas=True),
        "completion_len": pc.list_value_length(comp).cast(pa.int64()),
        "reward": table.column("reward"), "metadata": table.column("metadata"),
        "path": pa.array([str(path)] * table.num_rows, pa.string()),
    })


def log_paths(source: Source, episode_ids: set[str] | None) -> list[Path]:
    """The logs of a source: its episodes' ``<id>.arrow`` in its logdirs (None: every log there)."""
    out, seen = [], set()
    for d in source.logdirs:
        if episode_ids is None:
            cands = sorted(d.glob("*.arrow"))
        else:
            cands = [d / f"{e}.arrow" for e in sorted(episode_ids)]
        for p in cands:
            if p.stem not in seen and p.is_file():
                seen.add(p.stem)
                out.append(p)
    return out


def log_calls(sources: list[Source], episodes: dict[str, set[str] | None]) -> tuple[pl.DataFrame, pl.DataFrame, list]:
    """(calls, ends, errors): one row per call (harness, episode_id, call_index, status, error,
    auxiliary, times, prompt_len, completion_len, path), one per finished episode's end record
    (episode_id, reward, metadata JSON, path), and (path, why) for logs that cannot be read."""
    tables, errors = [], []
    for s in sources:
        for p in log_paths(s, episodes.get(s.name)):
            try:
                t = _log_frame(p)
            except LogError as exc:
                errors.append((str(p), str(exc)))
                continue
            tables.append(t.append_column("harness", pa.array([s.name] * t.num_rows, pa.string())))
    if not tables:
        empty = pl.DataFrame(schema={"harness": pl.String, "episode_id": pl.String, "kind": pl.String})
        return empty, empty, errors
    df = pl.from_arrow(pa.concat_tables(tables, promote_options="permissive"))
    calls = df.filter(pl.col("kind") == KIND_CALL).drop("reward", "metadata")
    ends = (df.filter(pl.col("kind") == KIND_END).select("harness", "episode_id", "reward", "metadata", "path")
            .unique(["harness", "episode_id"], keep="last", maintain_order=True))
    return calls, ends, errors


def end_metadata(ends: pl.DataFrame) -> pl.DataFrame:
    """The end records' metadata fields the report uses (`meta`: harness, status, reason) and
    whether the rollout discarded the episode (`discarded`: end_record.is_discarded, one rule)."""
    schema = pl.Struct({end.HARNESS: pl.String, end.STATUS: pl.String, end.REASON: pl.String})
    if ends.is_empty():
        if "metadata" not in ends.columns:
            return ends
        return ends.with_columns(pl.lit(None, schema).alias("meta"), pl.lit(False).alias("discarded"))
    # (one end record per episode: parsing each in Python is cheap; _log_frame refused non-objects)
    discarded = [end.is_discarded(end.parse_metadata(m, p)) for m, p in zip(ends["metadata"], ends["path"], strict=True)]
    return ends.with_columns(pl.col("metadata").str.json_decode(schema).alias("meta"),
                             pl.Series("discarded", discarded, pl.Boolean))


def manifest(source: Source) -> dict:
    """The recon manifest beside the shards: excluded episodes {id: {reason, status}} and excluded
    calls {id: [{call, choice, reason}]} (shard_writer.Manifest); {} when there is none."""
    if source.manifest is None:
        return {}
    try:
        data = json.loads(source.manifest.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{source.manifest}: the recon manifest is not JSON ({exc})") from None
    return data if isinstance(data, dict) else {}
