"""`polar-recon compare` end to end: resolve, load, aggregate, optionally re-measure drift, read
the trainers' logs, write the page and its token views. The CLI only prints."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import polars as pl

from .frames import ShardError
from .load import load
from .sources import SourceError, resolve
from .stats import compare
from .training import TrainerLogError, load_trainers


class CompareError(ValueError):
    """Bad input to compare (a path, a shard, a trainer log); the message names it."""


def _drift(data, tokenizer: str) -> dict[str, dict[str, Any]]:
    """Per harness: what `polar-recon drift` measures (retokenize vs token), over the episodes' logs."""
    from polar_contracts.log.arrays import read_calls
    from polar_contracts.log.table import LogError

    from ..diagnostics import Drift, drift_episode
    from ..strategies import ReconError, Retokenizer
    from ..tokens import TurnMarkers

    m, retok = TurnMarkers.load(tokenizer), Retokenizer(tokenizer)
    out = {}
    ends = data.ends
    if ends.is_empty():
        return out
    discard = ends["discarded"]
    for h in ends.filter(~discard)["harness"].unique().sort().to_list():
        d = Drift()
        # one episode at a time: linking and re-tokenizing are per episode (what `drift` does)
        for p in ends.filter((pl.col("harness") == h) & ~discard)["path"].to_list():
            try:
                drift_episode(read_calls(p, with_requests=True), m, retok, d, h)
            except (LogError, ReconError) as exc:
                d.skipped.append((p, str(exc)))
        out[h] = {**d.row(), "skipped": len(d.skipped)}
    return out


def run_compare(inputs: list[str], logdirs: list[str], trainers: list[str], *, solved_at: float = 1.0,
                drift: bool = False, tokenizer: str | os.PathLike | None = None, html_path: str | None = None,
                max_views: int = 20) -> dict[str, Any]:
    from ..tokens import DEFAULT_TOKENIZER

    tokenizer = tokenizer or DEFAULT_TOKENIZER
    try:
        data = load(resolve(inputs, logdirs))
    except (SourceError, ShardError, ValueError) as exc:
        raise CompareError(str(exc)) from None
    if not data.harnesses:
        raise CompareError(f"{', '.join(inputs)}: no episodes found (no shard rows, rollout records or logs)")
    report = compare(data, solved_at)
    try:
        report["trainers"] = load_trainers(trainers, data.harnesses)
    except TrainerLogError as exc:
        raise CompareError(str(exc)) from None
    if drift:
        for h, d in _drift(data, str(tokenizer)).items():
            if h in report["harnesses"]:
                report["harnesses"][h]["drift"] = d
    if html_path:
        from .page import render
        from .views import write_views

        out = Path(html_path)
        out.parent.mkdir(parents=True, exist_ok=True)
        vdir = out.with_name(out.stem + "_episodes")
        logs = data.ends.select("harness", "episode_id", "path") if not data.ends.is_empty() else pl.DataFrame()
        if not data.calls.is_empty():  # unfinished episodes have calls but no end record
            logs = pl.concat([logs, data.calls.select("harness", "episode_id", "path")]) if not logs.is_empty() \
                else data.calls.select("harness", "episode_id", "path")
            logs = logs.unique(["harness", "episode_id"])
        views = write_views(report, logs, vdir, str(tokenizer), max_views)
        report["views"] = views
        page = render(report, views)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(out)
    return report
