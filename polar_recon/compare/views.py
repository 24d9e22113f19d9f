"""The episodes behind the report's numbers, each written as the existing token view
(polar_recon/html.py, what `polar-recon show` writes) beside the report, so a link opens it."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import polars as pl

from polar_contracts.log.arrays import read_calls
from polar_contracts.log.table import LogError

from ..html import render_episode
from ..strategies import ReconError
from ..tokens import TurnMarkers

_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def referenced(h: dict[str, Any], per_list: int = 3) -> list[str]:
    """The episodes a harness's numbers name, most telling first: the maxima of each distribution,
    the worst re-render, then a few of each list (excluded, errors, breaks, unsolved, not trained)."""
    ids: list[str] = []

    def add(x):
        if x and x not in ids:
            ids.append(x)
    f, c, r = h["fidelity"], h["calls"], h["rows"]
    add((f.get("worst_rerender") or {}).get("episode"))
    for d in (r.get("tokens_per_episode"), c.get("calls_per_episode"), c.get("prompt_tokens_per_episode")):
        add((d or {}).get("max_episode"))
    for p in (h.get("phases_s") or {}).values():
        add((p or {}).get("max_episode"))
    lists = [*h["episodes"]["refs"]["excluded"].values(), h["episodes"]["refs"]["errors"], f["refs"]["breaks"],
             f["refs"]["rerendered"], h["reward"]["refs"]["unsolved"], *h["not_trained"]["refs"].values(),
             c.get("failed_refs") or []]
    for lst in lists:
        for x in lst[:per_list]:
            add(x)
    return ids


def view_name(harness: str, eid: str) -> str:
    return f"{_SAFE.sub('_', harness)}/{_SAFE.sub('_', eid)}.html"


def write_views(report: dict[str, Any], log_paths: pl.DataFrame, out_dir: Path, tokenizer: str,
                limit: int = 20) -> dict[str, dict[str, str]]:
    """Writes up to ``limit`` token views per harness into out_dir; returns {harness: {episode:
    relative path or "no view: why"}}. ``log_paths``: harness, episode_id, path of every log read."""
    m = TurnMarkers.load(tokenizer)
    paths = {(h, e): p for h, e, p in log_paths.select("harness", "episode_id", "path").iter_rows()} \
        if not log_paths.is_empty() else {}
    out: dict[str, dict[str, str]] = {}
    for harness, h in report["harnesses"].items():
        got = out.setdefault(harness, {})
        for eid in referenced(h)[:limit]:
            p = paths.get((harness, eid))
            if p is None:
                got[eid] = "no view: its log was not found (pass --logdir)"
                continue
            try:
                page = render_episode(read_calls(p), m, tokenizer)
            except (LogError, ReconError, ValueError) as exc:
                got[eid] = f"no view: {exc}"
                continue
            rel = view_name(harness, eid)
            dest = out_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(page, encoding="utf-8")
            got[eid] = f"{out_dir.name}/{rel}"
    return out
