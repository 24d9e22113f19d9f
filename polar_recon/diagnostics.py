"""Diagnostics over logs and shards: per-call inspection (`inspect_rows`), strategy drift
(`drift`), shard statistics (`shard_stats`): pure data, `polar-recon inspect / drift / stats` print
them. (The cross-harness comparison report is compare/.)"""
from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from polar_contracts.log import end_record as end
from polar_contracts.log.arrays import Episode, list_logs, read_calls
from polar_contracts.log.table import LogError
from polar_contracts.prefix import common_prefix
from polar_contracts.shards import MANIFEST
from polar_recon.shard_writer import list_shards

from .link import CLEAN, REALIGN, link_calls, segments
from .strategies import ReconError, Retokenizer, retokenize_sequences, token_sequences
from .tokens import TurnMarkers

# ---------------------------------------------------------------------------------------------
# inspect


def inspect_rows(ep: Episode, m: TurnMarkers) -> list[dict[str, Any]]:
    nodes = link_calls(ep.calls, m)
    segments(nodes)
    rows = []
    by_index = {k: n.call.call_index for k, n in enumerate(nodes)}
    for n in nodes:
        c, i = n.call, n.call.info
        rows.append({
            "call": c.call_index,
            "api": i.get("api"),
            "prompt": None if c.prompt is None else len(c.prompt),
            "completion": None if c.completion is None else len(c.completion),
            "link": n.kind,
            "parent": by_index.get(n.parent) if n.parent is not None else None,
            "new": None if c.prompt is None else len(c.prompt) - n.keep_from if n.kind in (CLEAN, REALIGN) else None,
            "realigned": n.realigned,
            "segment": n.segment,
            "ttfb_ms": _ms(i.get("t_first_byte"), i.get("t_start")),
            "total_ms": _ms(i.get("t_end"), i.get("t_start")),
            "status": i.get("status"),
            "finish": i.get("finish_reason"),
            "weights": i.get("weight_version"),
            # the sampling the server applied (None: unknown) and what the logprobs are
            "temperature": i.get("temperature"),
            "top_p": i.get("top_p"),
            "top_k": i.get("top_k"),
            "min_p": i.get("min_p"),
            "logprobs_mode": i.get("logprobs_mode"),
            "sampling_unsupported": i.get("sampling_unsupported"),
            "error": i.get("error") or (n.note or None),
        })
    return rows


def _ms(a, b):
    return None if a is None or b is None else round((a - b) * 1000.0, 1)


# ---------------------------------------------------------------------------------------------
# drift


@dataclass
class Drift:
    episodes: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    trainable: int = 0  # sampled tokens under `token`
    differing: int = 0  # of those, tokens whose id differs under `retokenize`
    sequences: int = 0
    sequences_affected: int = 0
    logprob_misplaced: int = 0  # retokenize: positions whose attached logprob belongs to another id
    per_call_sequences: int = 0
    per_call_tokens: int = 0
    token_tokens: int = 0
    kinds: dict[str, Counter] = field(default_factory=dict)  # harness -> Counter of link kinds
    # harness -> context tokens of `token` rows that differ from what the model was served (known
    # re-render classes only; `per-call` rows have none by construction), and the classes seen
    context_divergent: dict[str, int] = field(default_factory=dict)
    context_tokens: dict[str, int] = field(default_factory=dict)
    realign_classes: dict[str, Counter] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        return {
            "episodes": self.episodes, "sequences": self.sequences, "trainable_tokens": self.trainable,
            "retokenize_differing_tokens": self.differing,
            "retokenize_differing_share": self.differing / self.trainable if self.trainable else 0.0,
            "retokenize_sequences_affected": self.sequences_affected,
            "retokenize_logprobs_misplaced": self.logprob_misplaced,
            "token_sequence_tokens": self.token_tokens,
            "per_call_sequences": self.per_call_sequences, "per_call_tokens": self.per_call_tokens,
            "per_call_token_blowup": self.per_call_tokens / self.token_tokens if self.token_tokens else 0.0,
            "context_divergent_tokens": sum(self.context_divergent.values()),
            "per_call_context_divergent_tokens": 0,
        }


def turn_diff(sampled: np.ndarray, other: np.ndarray) -> int:
    """Sampled tokens not reproduced by `other`: all but the common prefix and common suffix."""
    p = common_prefix(sampled, other)
    s = common_prefix(sampled[p:][::-1], other[p:][::-1])
    return len(sampled) - p - s


def _spans(mask: np.ndarray) -> list[tuple[int, int]]:
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist()))


def drift_episode(ep: Episode, m: TurnMarkers, retok: Retokenizer, d: Drift, harness: str) -> None:
    nodes = link_calls(ep.calls, m)
    toks = token_sequences(ep, m, nodes)
    d.kinds.setdefault(harness, Counter()).update(n.kind for n in nodes)
    chains = segments(nodes)  # rows split by the fidelity check or --max-len are their own chains
    rets = {tuple(r.call_rows): r for r in retokenize_sequences(ep, m, retok, nodes)}
    d.context_divergent[harness] = d.context_divergent.get(harness, 0) + sum(t.realign_tokens or 0 for t in toks)
    d.context_tokens[harness] = d.context_tokens.get(harness, 0) + sum(int((~t.loss_mask.astype(bool)).sum()) for t in toks)
    d.realign_classes.setdefault(harness, Counter()).update(c for t in toks for c in t.realign_classes)
    for chain in chains:
        rows = tuple(nodes[k].call.row for k in chain)
        t = next((x for x in toks if tuple(x.call_rows) == rows), None)
        r = rets.get(rows)
        if t is None or r is None:
            continue
        sampled = [nodes[k].call for k in chain]
        spans = _spans(r.loss_mask)[-len(sampled):]
        diff = misplaced = 0
        for k, call in enumerate(sampled):
            if k < len(sampled) - len(spans):
                diff += len(call.completion)  # the turn is not in the final text at all
                continue
            a, b = spans[k - (len(sampled) - len(spans))]
            other = r.input_ids[a:b]
            diff += turn_diff(call.completion, other)
            n = min(len(other), len(call.completion))
            misplaced += int(np.count_nonzero(other[:n] != call.completion[:n])) + abs(len(other) - len(call.completion))
        d.trainable += int(t.loss_mask.sum())
        d.token_tokens += len(t.input_ids)
        d.differing += diff
        d.logprob_misplaced += misplaced
        d.sequences += 1
        d.sequences_affected += diff > 0
    for c in ep.calls:
        if c.usable:
            d.per_call_sequences += 1
            d.per_call_tokens += len(c.prompt) + len(c.completion)
    d.episodes += 1


def drift(logdir: str | os.PathLike, m: TurnMarkers, retok: Retokenizer, harness_key: str = end.HARNESS,
          progress: Callable | None = None) -> Drift:
    d = Drift()
    paths = list_logs(logdir)
    for p in (progress(paths) if progress else paths):
        try:
            ep = read_calls(p, with_requests=True)
            if not ep.finished:
                d.skipped.append((str(p), "unfinished"))
                continue
            if end.is_discarded(ep.metadata):
                d.skipped.append((str(p), "discarded by the rollout (metadata.discard)"))
                continue
            drift_episode(ep, m, retok, d, str(ep.metadata.get(harness_key, "unknown")))
        except (LogError, ReconError) as exc:
            d.skipped.append((str(p), str(exc)))
    return d


# ---------------------------------------------------------------------------------------------
# stats


def shard_stats(out: str | os.PathLike) -> dict[str, Any]:
    shards = list_shards(out)
    if not shards:
        raise FileNotFoundError(f"{out}: no shard-*.parquet files")
    cols = ["episode_id", "group_id", "segment", "reward", "n_calls", "n_realign", "group_complete", "strategy",
            "input_ids", "loss_mask"]
    optional = {"logprobs_mode": pl.String, "sampling_unsupported": pl.String, "termination": pl.String,
                "realign_tokens": pl.Int32, "realign_classes": pl.List(pl.String)}
    parts = []
    for p in shards:
        have = pq.read_schema(p).names  # shards of older builds have no sampling / fidelity columns
        df = pl.read_parquet(p, columns=cols + [c for c in optional if c in have])
        for c, t in optional.items():
            if c not in df.columns:
                df = df.with_columns(pl.lit(None, t).alias(c))
        df = df.with_columns(
            pl.col("input_ids").list.len().alias("tokens"),
            pl.col("loss_mask").list.sum().alias("trainable"),
        ).drop("input_ids", "loss_mask")
        parts.append(df)
    df = pl.concat(parts)
    ep = df.group_by("episode_id").agg(pl.col("reward").first())
    r = ep["reward"]
    hist = np.histogram(r.to_numpy(), bins=min(10, max(1, r.n_unique())))
    return {
        "shards": len(shards),
        "strategy": sorted(df["strategy"].unique().to_list()),
        "episodes": ep.height,
        "groups": df["group_id"].n_unique(),
        "incomplete_groups": df.filter(~pl.col("group_complete"))["group_id"].n_unique(),
        "segments": df.height,
        "calls": int(df["n_calls"].sum()),
        "realigned_turns": int(df["n_realign"].sum()),
        "tokens": int(df["tokens"].sum()),
        "trainable_tokens": int(df["trainable"].sum()),
        "reward_mean": float(r.mean()), "reward_std": float(r.std() or 0.0),
        "reward_min": float(r.min()), "reward_max": float(r.max()),
        # what the trainer's importance ratios can use: rows per logprobs mode (None: unknown)
        # and rows whose sampling the four parameters cannot reproduce
        "logprobs_modes": {str(k): int(v) for k, v in zip(*np.unique(
            np.asarray([str(x) for x in df["logprobs_mode"].to_list()]), return_counts=True))},
        "sampling_unsupported_rows": int(df["sampling_unsupported"].is_not_null().sum()),
        # context fidelity: context tokens that differ from what the model was served (known
        # re-render classes only), per harness is `drift`'s; rows per class and per termination
        "context_divergent_tokens": int(df["realign_tokens"].fill_null(0).sum()),
        "realign_classes": {str(k): int(v) for k, v in zip(*np.unique(
            np.asarray([c for cs in df["realign_classes"].to_list() if cs for c in cs], dtype=object).astype(str),
            return_counts=True))},
        "terminations": {str(k): int(v) for k, v in zip(*np.unique(
            np.asarray([str(x) for x in df["termination"].to_list()]), return_counts=True))},
        "reward_histogram": [(float(a), float(b), int(c)) for a, b, c in zip(hist[1][:-1], hist[1][1:], hist[0])],
        **_excluded(out),
    }


def _excluded(out: str | os.PathLike) -> dict[str, Any]:
    """Episodes the builds saw and left out on purpose (the manifest keeps them; shards cannot)."""
    path = Path(out) / MANIFEST
    try:
        excluded = json.loads(path.read_text()).get("excluded") or {}
    except (OSError, ValueError, AttributeError):
        excluded = {}
    ids = sorted(e for e, v in excluded.items() if isinstance(v, dict) and v.get("reason") == "discard")
    try:
        data = json.loads(path.read_text())
        counts, calls = data.get("excluded_counts") or {}, data.get("excluded_calls") or {}
    except (OSError, ValueError, AttributeError):
        counts, calls = {}, {}
    return {"discarded": len(ids), "discarded_ids": ids, "excluded_counts": counts, "excluded_calls": calls}
