"""Per-harness numbers of `polar-recon compare` (docs/report.md defines each), all polars
aggregations over the frames of load.py. Every distribution names the episode at its maximum and
every count of left-out things names its episodes (``refs``), so the report can link them.
"""
from __future__ import annotations

import math
from typing import Any

import polars as pl

from polar_contracts.log.end_record import STATUS

from ..ledger import Ledger
from .frames import PHASES
from .load import Data

# Two-sided 95% Student t quantiles for 1..30 degrees of freedom (scipy is not a dependency); the
# normal 1.96 beyond: with a handful of episodes per harness a normal interval would be too narrow.
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
PHASE_NAMES = {"prewarm": "prewarm", "run": "agent", "eval": "eval", "recon": "recon"}
MAX_IDS = 50  # episodes named per left-out reason (the JSON says how many there are in all)


def t95(n: int) -> float:
    return _T95[n - 2] if 2 <= n <= len(_T95) + 1 else 1.96


def mean_ci(values: pl.Series) -> dict[str, Any]:
    """Mean and its 95% confidence interval, never outside the values' range: a reward that is only
    ever 0 or 1 is a proportion (Wilson score interval, within [0, 1]); any other, Student t on the
    sample standard deviation clipped to [min, max] (with two episodes the t interval alone spans
    many times the range: 0.5 [-5.85, 6.85] for a 0 and a 1). ``ci_method`` names which."""
    v = values.drop_nulls().cast(pl.Float64)
    n = v.len()
    if n == 0:
        return {"n": 0, "mean": None, "ci95": None, "ci_method": None}
    mean = float(v.mean())
    if n < 2:
        return {"n": 1, "mean": mean, "ci95": None, "ci_method": None}
    if v.is_in([0.0, 1.0]).all():
        return {"n": n, "mean": mean, "ci95": wilson(int(v.sum()), n), "ci_method": "wilson"}
    half = t95(n) * float(v.std()) / math.sqrt(n)
    lo, hi = float(v.min()), float(v.max())
    return {"n": n, "mean": mean, "ci95": [max(lo, mean - half), min(hi, mean + half)], "ci_method": "t, clipped"}


def wilson(k: int, n: int) -> list[float] | None:
    """95% Wilson score interval of a proportion k/n (sound at 0/n and n/n, unlike the normal one)."""
    if n == 0:
        return None
    z, p = 1.96, k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, c - h), min(1.0, c + h)]


def dist(df: pl.DataFrame, col: str, id_col: str = "episode_id") -> dict[str, Any] | None:
    """n, mean, p50, p90, max of ``col`` and the episode at the max (None when there are no values)."""
    d = df.filter(pl.col(col).is_not_null())
    if d.is_empty():
        return None
    s = d[col].cast(pl.Float64)
    top = d.sort(col, descending=True).row(0, named=True)
    return {"n": d.height, "mean": float(s.mean()), "p50": float(s.quantile(0.5, "nearest")),
            "p90": float(s.quantile(0.9, "nearest")), "max": float(s.max()), "max_episode": top[id_col]}


def quartiles(df: pl.DataFrame, col: str) -> dict[str, float] | None:
    """A box plot's five numbers (precomputed: the page never embeds one point per episode)."""
    s = df[col].drop_nulls().cast(pl.Float64) if col in df.columns else pl.Series([], dtype=pl.Float64)
    if s.is_empty():
        return None
    return {"min": float(s.min()), "q1": float(s.quantile(0.25, "linear")), "median": float(s.median()),
            "q3": float(s.quantile(0.75, "linear")), "max": float(s.max()), "mean": float(s.mean())}


def _counts(s: pl.Series) -> dict[str, int]:
    vc = s.fill_null("unknown").cast(pl.String).value_counts(sort=True)
    return {str(k): int(v) for k, v in zip(vc[vc.columns[0]].to_list(), vc["count"].to_list())}


def _episodes(data: Data, h: str, eps: pl.DataFrame) -> dict[str, Any]:
    recs = data.records.filter(pl.col("harness") == h) if not data.records.is_empty() else data.records
    excluded: dict[str, list[str]] = {}
    seen: set[str] = set()
    for m in data.manifests.get(h, []):
        for eid, v in (m.get("excluded") or {}).items():
            v = v if isinstance(v, dict) else {}
            # the reason recon gave, refined by the rollout's status (discard: eval_error, ...)
            key = str(v.get("reason") or "unknown") + (f": {v['status']}" if v.get("status") else "")
            excluded.setdefault(key, []).append(eid)
            seen.add(eid)
    ends = data.ends.filter(pl.col("harness") == h) if not data.ends.is_empty() else data.ends
    if not ends.is_empty():  # discarded by the rollout (end metadata) but not in a manifest: no recon ran
        disc = ends.filter(pl.col("discarded") & ~pl.col("episode_id").is_in(seen))
        for eid, st in zip(disc["episode_id"].to_list(), disc["meta"].struct.field(STATUS).to_list()):
            excluded.setdefault(f"discard: {st or 'unknown'}", []).append(eid)
    by_status = _counts(recs["status"]) if not recs.is_empty() else {}
    errored = recs.filter(pl.col("status").is_in(["error", "crashed", "eval_error", "interrupted"])) \
        if not recs.is_empty() else recs
    return {"recorded": recs.height, "by_status": by_status, "built": eps.height,
            "logs": ends.height, "excluded": {k: len(v) for k, v in sorted(excluded.items())},
            "errors": errored.height,
            "refs": {"excluded": {k: sorted(v)[:MAX_IDS] for k, v in sorted(excluded.items())},
                     "errors": sorted(errored["episode_id"].to_list())[:MAX_IDS] if not errored.is_empty() else []}}


def _calls(data: Data, h: str, eps: pl.DataFrame) -> dict[str, Any]:
    calls = data.calls.filter(pl.col("harness") == h) if "harness" in data.calls.columns else data.calls
    out: dict[str, Any] = {"source": "logs" if not calls.is_empty() else "shards"}
    if calls.is_empty():  # no logs: the calls the shards hold (trained calls only)
        out["calls_per_episode"] = dist(eps, "calls")
        return out
    per = calls.group_by("episode_id").agg(
        pl.len().alias("calls"), pl.col("auxiliary").fill_null(False).sum().alias("auxiliary"),
        pl.col("error").is_not_null().sum().alias("failed"),
        pl.col("prompt_len").sum().alias("prompt_tokens"), pl.col("completion_len").sum().alias("completion_tokens"),
        (pl.col("t_end") - pl.col("t_start")).sum().alias("model_s"))
    dur = calls.with_columns(((pl.col("t_end") - pl.col("t_start")) * 1000).alias("call_ms"),
                             ((pl.col("t_first_byte") - pl.col("t_start")) * 1000).alias("ttfb_ms"))
    out.update(calls_per_episode=dist(per, "calls"), prompt_tokens_per_episode=dist(per, "prompt_tokens"),
               completion_tokens_per_episode=dist(per, "completion_tokens"),
               auxiliary_calls=int(per["auxiliary"].sum()), failed_calls=int(per["failed"].sum()),
               call_ms=dist(dur.with_columns(pl.format("{} call {}", "episode_id", "call_index").alias("call")),
                            "call_ms", "call"),
               ttfb_ms=dist(dur.with_columns(pl.format("{} call {}", "episode_id", "call_index").alias("call")),
                            "ttfb_ms", "call"),
               failed_refs=sorted(calls.filter(pl.col("error").is_not_null())["episode_id"].unique().to_list())[:MAX_IDS],
               box={"prompt_tokens": quartiles(per, "prompt_tokens"),
                    "completion_tokens": quartiles(per, "completion_tokens"), "calls": quartiles(per, "calls")})
    recs = data.records.filter(pl.col("harness") == h) if not data.records.is_empty() else data.records
    if not recs.is_empty():
        # The agent phase's wall time inside model calls (request in -> response out at the proxy),
        # the rest being the harness's own work (tools, its process). The proxy's own part of a call
        # is not separable: the log has no upstream-send time.
        j = per.join(recs.select("episode_id", "run_s"), on="episode_id", how="inner").filter(pl.col("run_s") > 0)
        out["model_share_of_agent"] = float(j["model_s"].sum() / j["run_s"].sum()) if not j.is_empty() else None
    out["proxy_own_share"] = None
    return out


def _phases(data: Data, h: str) -> dict[str, Any]:
    recs = data.records.filter(pl.col("harness") == h) if not data.records.is_empty() else data.records
    if recs.is_empty():
        return {}
    return {PHASE_NAMES[p]: dist(recs, f"{p}_s") for p in PHASES}


def _reward(eps: pl.DataFrame, solved_at: float, source: str = "shards") -> dict[str, Any]:
    r = mean_ci(eps["reward"])
    r["source"] = source
    n = eps["reward"].drop_nulls().len()
    k = int((eps["reward"] >= solved_at).sum()) if n else 0
    r.update(solved_at=solved_at, solved=k, solve_rate=k / n if n else None, solve_ci95=wilson(k, n),
             std=float(eps["reward"].std()) if n > 1 else None)
    low = eps.filter(pl.col("reward") < solved_at).sort("reward")["episode_id"].to_list()
    r["refs"] = {"unsolved": low[:MAX_IDS]}
    return r


def _fidelity(rows: pl.DataFrame, eps: pl.DataFrame) -> dict[str, Any]:
    context = int((rows["tokens"] - rows["trainable"]).sum())
    realign = int(rows["realign_tokens"].fill_null(0).sum())
    cls = (rows.select("realign_classes", pl.col("realign_tokens").fill_null(0)).explode("realign_classes")
           .filter(pl.col("realign_classes").is_not_null())
           .group_by("realign_classes").agg(pl.len().alias("rows"), pl.col("realign_tokens").sum().alias("tokens"))
           .sort("tokens", descending=True))
    worst = eps.filter(pl.col("realign_tokens") > 0).sort("realign_tokens", descending=True)
    forks = eps.filter(pl.col("segments") > 1).sort("segments", descending=True)
    return {
        "context_tokens": context, "realign_tokens": realign, "realign_share": realign / context if context else 0.0,
        "rows": rows.height, "rows_realigned": int((rows["realign_tokens"].fill_null(0) > 0).sum()),
        "realigned_turns": int(rows["n_realign"].fill_null(0).sum()),
        # a row with several classes counts its tokens toward each (the row does not split them)
        "classes": {c: {"rows": int(r), "tokens": int(t), "share": int(t) / context if context else 0.0}
                    for c, r, t in zip(cls["realign_classes"].to_list(), cls["rows"].to_list(), cls["tokens"].to_list())},
        # chain breaks: every row of an episode after its first starts a new segment (FORK, or a split)
        "chain_breaks": int((eps["segments"] - 1).sum()), "episodes_with_breaks": forks.height,
        "unknown_fidelity_rows": int(rows["realign_tokens"].is_null().sum()),
        "worst_rerender": None if worst.is_empty() else {"episode": worst["episode_id"][0],
                                                        "tokens": int(worst["realign_tokens"][0])},
        "refs": {"rerendered": worst["episode_id"].to_list()[:MAX_IDS], "breaks": forks["episode_id"].to_list()[:MAX_IDS]},
    }


def _not_trained(data: Data, h: str) -> dict[str, Any]:
    counts: dict[str, int] = {}
    refs: dict[str, list[str]] = {}
    for m in data.manifests.get(h, []):
        for eid, cs in (m.get("excluded_calls") or {}).items():
            for c in cs if isinstance(cs, list) else []:
                reason = str(c.get("reason") if isinstance(c, dict) else "unknown")
                counts[reason] = counts.get(reason, 0) + 1
                if eid not in refs.setdefault(reason, []):
                    refs[reason].append(eid)
    return {"samples": dict(sorted(counts.items())), "refs": {k: sorted(v)[:MAX_IDS] for k, v in sorted(refs.items())}}


def _ledger(data: Data, h: str) -> dict[str, Any]:
    """The coverage ledger (polar_recon/ledger.py) of the harness's built episodes, summed over its
    manifests: sampled completion tokens = trained + excluded by reason. `episodes_without_ledger`
    counts built episodes of manifests written before the ledger (not in the sums)."""
    total, missing = Ledger(), 0
    for m in data.manifests.get(h, []):
        ledgers = m.get("ledger") or {}
        for eid, d in ledgers.items():
            total.add(Ledger.from_json(d, f"{h}: manifest ledger of {eid}"))
        missing += sum(1 for e in (m.get("episodes") or {}) if e not in ledgers)
    out = total.to_json()
    out.update(episodes_without_ledger=missing, closes=total.closes,
               accounted_share=total.accounted / total.sampled if total.sampled else None,
               trained_share=total.trained / total.sampled if total.sampled else None)
    return out


def _by_version(eps: pl.DataFrame, solved_at: float) -> list[dict[str, Any]]:
    g = (eps.group_by(pl.col("weight_version").fill_null("unknown"))
         .agg(pl.len().alias("episodes"), pl.col("reward").mean().alias("reward_mean"),
              (pl.col("reward") >= solved_at).mean().alias("solve_rate"),
              (pl.col("trainable").sum() / pl.col("tokens").sum()).alias("trainable_share"))
         .sort("weight_version"))
    return g.to_dicts()


def _verdicts(data: Data, h: str) -> dict[str, dict[str, Any]]:
    """Per policy version: finished episodes and how many were discarded, eval errors, tampered
    (the recon manifests' ``verdicts``, polar_recon/verdicts.py)."""
    from polar_recon.verdicts import counts
    merged: dict[str, dict] = {}
    for m in data.manifests.get(h, []):
        merged.update(m.get("verdicts") or {})
    return counts(merged)


def _rewarded(data: Data, h: str, eps: pl.DataFrame) -> tuple[pl.DataFrame, str]:
    """(episode_id, reward) of the harness's episodes and where they come from: the shards when any
    were built, else the logs' end records (a bare log directory; discarded episodes left out)."""
    if eps.height or data.ends.is_empty():
        return eps.select("episode_id", "reward"), "shards"
    ends = data.ends.filter((pl.col("harness") == h) & ~pl.col("discarded"))
    return ends.select("episode_id", pl.col("reward").cast(pl.Float64)), "end records"


def harness_stats(data: Data, h: str, solved_at: float = 1.0) -> dict[str, Any]:
    rows = data.rows.filter(pl.col("harness") == h)
    eps = data.episodes.filter(pl.col("harness") == h)
    tokens, trainable = int(rows["tokens"].sum()), int(rows["trainable"].sum())
    rewarded, source = _rewarded(data, h, eps)
    return {
        "harness": h,
        "episodes": _episodes(data, h, eps),
        "calls": _calls(data, h, eps),
        "rows": {"rows": rows.height, "tokens": tokens, "trainable": trainable,
                 "trainable_share": trainable / tokens if tokens else None,
                 "tokens_per_episode": dist(eps, "tokens"), "trainable_per_episode": dist(eps, "trainable")},
        "phases_s": _phases(data, h),
        "reward": _reward(rewarded, solved_at, source),
        "terminations": {"rows": _counts(rows["termination"]) if rows.height else {},
                         "episodes": _counts(eps["termination"]) if eps.height else {}},
        "fidelity": _fidelity(rows, eps),
        "not_trained": _not_trained(data, h),
        "ledger": _ledger(data, h),
        "by_weight_version": _by_version(eps, solved_at),
        "verdicts_by_version": _verdicts(data, h),
    }


def compare(data: Data, solved_at: float = 1.0) -> dict[str, Any]:
    return {"harnesses": {h: harness_stats(data, h, solved_at) for h in data.harnesses},
            "sources": [{"harness": data.rename.get(s.name, s.name), "root": str(s.root), "shards": len(s.shards),
                         "records": len(s.records), "logdirs": [str(d) for d in s.logdirs]} for s in data.sources],
            "log_errors": [{"path": p, "error": e} for p, e in data.log_errors]}
