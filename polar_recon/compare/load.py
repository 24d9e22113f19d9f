"""Everything `polar-recon compare` reads, once, as frames keyed by harness (frames.py does the reads)."""
from __future__ import annotations

from dataclasses import dataclass, field

import polars as pl

from polar_contracts.log.end_record import HARNESS

from . import frames
from .sources import Source


@dataclass
class Data:
    sources: list[Source]
    rows: pl.DataFrame  # shard rows
    episodes: pl.DataFrame  # one per built episode (aggregated shard rows)
    records: pl.DataFrame  # rollout records
    calls: pl.DataFrame  # log call rows
    ends: pl.DataFrame  # log end records (with `meta`)
    manifests: dict[str, list[dict]] = field(default_factory=dict)  # harness -> its sources' manifests
    log_errors: list[tuple[str, str]] = field(default_factory=list)
    rename: dict[str, str] = field(default_factory=dict)  # source name -> the harness its records name

    @property
    def harnesses(self) -> list[str]:
        names = set(self.rows["harness"]) | set(self.records.get_column("harness", default=pl.Series([], dtype=pl.String)))
        names |= set(self.calls.get_column("harness", default=pl.Series([], dtype=pl.String)))
        return sorted(n for n in names if n is not None)


def episodes_of(rows: pl.DataFrame) -> pl.DataFrame:
    """Built episodes: reward, rows (segments), calls, tokens, trainable, context fidelity, the
    weight version of their first row and the termination of their last."""
    return (rows.sort("harness", "episode_id", "segment")
            .group_by("harness", "episode_id", maintain_order=True)
            .agg(pl.col("reward").first(), pl.len().alias("segments"), pl.col("n_calls").sum().alias("calls"),
                 pl.col("tokens").sum(), pl.col("trainable").sum(),
                 pl.col("realign_tokens").fill_null(0).sum().alias("realign_tokens"),
                 pl.col("n_realign").fill_null(0).sum().alias("realigned_turns"),
                 pl.col("weight_version").first(), pl.col("termination").last(), pl.col("group_id").first()))


def load(sources: list[Source]) -> Data:
    rows = frames.shard_rows(sources)
    recs = frames.records(sources)
    # A source's harness: the one its records name (a run OUT or store holds one recipe), unless
    # NAME= gave one; rows, records and calls of the source are relabelled alike.
    rename: dict[str, str] = {}
    for s in sources:
        if s.label is None and not recs.is_empty():
            names = recs.filter(pl.col("source") == s.name)["harness"].drop_nulls().unique().to_list()
            if len(names) == 1:
                rename[s.name] = names[0]
    ids: dict[str, set[str] | None] = {}
    for s in sources:
        mine = set(rows.filter(pl.col("harness") == s.name)["episode_id"].to_list())
        if not recs.is_empty():
            mine |= set(recs.filter(pl.col("source") == s.name)["episode_id"].to_list())
        mine |= set(frames.manifest(s).get("excluded") or {})  # left out by recon: their logs tell why
        ids[s.name] = mine if (s.shards or s.records) else None  # a bare logdir: all its logs
    calls, ends, errors = frames.log_calls(sources, ids)
    ends = frames.end_metadata(ends)
    # A bare log directory: each episode's harness from its end metadata (else the directory's name).
    bare = {s.name for s in sources if ids[s.name] is None and s.label is None}
    if bare and not ends.is_empty():
        by_meta = ends.select("episode_id", pl.col("meta").struct.field(HARNESS).alias("_h"))
        # an unfinished episode has no end record: it goes with its directory's only harness, if one
        only = {}
        for b in bare:
            names = ends.filter(pl.col("harness") == b)["meta"].struct.field(HARNESS).drop_nulls().unique().to_list()
            if len(names) == 1:
                only[b] = names[0]
        calls = calls.join(by_meta, on="episode_id", how="left").with_columns(
            pl.when(pl.col("harness").is_in(list(bare)))
            .then(pl.coalesce(pl.col("_h"), pl.col("harness").replace(only))).otherwise(pl.col("harness"))
            .alias("harness")).drop("_h")
        ends = ends.with_columns(
            pl.when(pl.col("harness").is_in(list(bare)) & pl.col("meta").struct.field(HARNESS).is_not_null())
            .then(pl.col("meta").struct.field(HARNESS)).otherwise(pl.col("harness")).alias("harness"))
    if rename:
        def relabel(df: pl.DataFrame, col: str = "harness") -> pl.DataFrame:
            return df.with_columns(pl.col(col).replace(rename)) if col in df.columns else df
        rows, calls, ends = relabel(rows), relabel(calls), relabel(ends)
    if not recs.is_empty():
        # the record's own harness when the source is unnamed, else the name given
        recs = recs.with_columns(pl.when(pl.col("source").is_in([s.name for s in sources if s.label]))
                                 .then(pl.col("source")).otherwise(pl.col("harness").fill_null(pl.col("source")))
                                 .alias("harness"))
    manifests: dict[str, list[dict]] = {}
    for s in sources:
        m = frames.manifest(s)
        if m:
            manifests.setdefault(rename.get(s.name, s.name), []).append(m)
    return Data(sources=sources, rows=rows, episodes=episodes_of(rows), records=recs, calls=calls, ends=ends,
                manifests=manifests, log_errors=errors, rename=rename)
