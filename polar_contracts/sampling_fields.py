"""The sampling columns' rules (log schema v3, shard columns): one definition for the addon that
writes them and the reconstruction that carries them into shards.

Columns: ``temperature``, ``top_p``, ``top_k``, ``min_p`` (the values the server ACTUALLY applied),
``logprobs_mode``, ``sampling_unsupported`` and ``sampling_source`` (their types: SAMPLING_FIELDS
below). Values are normalised so that one distribution has one spelling whatever the server:

- ``top_k`` disabled is -1 (vLLM accepts 0 or -1, SGLang -1 and uses ``1 << 30`` internally);
- ``top_p`` disabled is 1.0, ``min_p`` disabled is 0.0;
- greedy is ``temperature`` 0.0 (vLLM and SGLang both treat T < 1e-5 as greedy), and then the
  truncations are irrelevant and written disabled (vLLM's SamplingParams does the same);
- null is unknown (the proxy could not know), never a guess.

A shard row merges the calls of one sequence (`combine`): a field on which its calls differ is
null, with the reason ``MIXED`` in ``sampling_unsupported``; every call's reasons are kept.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

# The columns, in log and shard schema order (log schema v3 added them; the shards carry them
# unchanged): the sampling the server ACTUALLY applied (the request's value, else the served
# model's default; see addon/applied_sampling.py).
SAMPLING_FIELDS: list[pa.Field] = [
    # Normalised: top_k disabled = -1, top_p disabled = 1.0, min_p disabled = 0.0, greedy =
    # temperature 0.0; null = unknown (never guessed).
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("top_k", pa.int32()),
    pa.field("min_p", pa.float64()),
    # what the server's logprobs are: "processed" (after temperature, penalties and the
    # top-k/top-p/min-p masks, renormalised: vLLM --logprobs-mode processed_logprobs), "raw"
    # (log-softmax of the raw logits: stock vLLM), "scaled" (log-softmax of logits/T before any
    # truncation: SGLang 0.5.23); null = unknown (the addon's probe could not tell)
    pa.field("logprobs_mode", pa.string()),
    # null when temperature/top_p/top_k/min_p alone reproduce the sampling distribution; else the
    # "; "-joined reasons they do not (penalties, logit_bias, structured output, ...)
    pa.field("sampling_unsupported", pa.string()),
    # Where the four values come from (log schema v4; SOURCES below): "request" (the request set them
    # all), "option: <path>" (polar_generation_config gave the defaults the proxy filled in),
    # "discovered: <how>" (the proxy asked the server which model it serves and read its
    # generation_config.json), "unknown: <why>" (some are null: the reason, and the fix). Null: a
    # log or shard older than the column. Several calls that differ: their sources "; "-joined.
    pa.field("sampling_source", pa.string()),
]
COLUMNS = tuple(f.name for f in SAMPLING_FIELDS)
PARAMS = COLUMNS[:4]  # the numeric parameters: temperature, top_p, top_k, min_p
LOGPROBS_MODES = ("processed", "raw", "scaled")
MIXED = "mixed sampling parameters across calls"
SOURCES = ("request", "option", "discovered", "unknown")  # sampling_source's kinds (the text before ":")
GREEDY_EPS = 1e-5  # vLLM _SAMPLING_EPS, SGLang's greedy threshold: below it the server samples greedily
TOP_K_ALL = 1 << 30  # SGLang's "no top-k" (sampling_params.py TOP_K_ALL)


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def normalise(temperature: Any, top_p: Any, top_k: Any, min_p: Any) -> dict[str, Any]:
    """The four parameters in the columns' spelling (None stays None: unknown)."""
    t, p, m = _number(temperature), _number(top_p), _number(min_p)
    k = _number(top_k)
    k_out: int | None = None
    if k is not None:
        k_out = -1 if k <= 0 or k >= TOP_K_ALL else int(k)
    if t is not None and t < GREEDY_EPS:  # greedy: the truncations change nothing
        return {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}
    return {"temperature": t, "top_p": p, "top_k": k_out, "min_p": m}


def combine(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The sampling columns of a sequence made of these calls' rows: a value all calls share, or
    null plus the reason ``MIXED``; the reasons of every call, once each, in order."""
    rows = list(rows)
    out: dict[str, Any] = {}
    mixed = False
    for c in (*PARAMS, "logprobs_mode"):
        values = {r.get(c) for r in rows}
        if len(values) > 1:
            out[c], mixed = None, True
        else:
            out[c] = values.pop() if values else None
    reasons: list[str] = []
    for r in rows:
        for part in (r.get("sampling_unsupported") or "").split("; "):
            if part and part not in reasons:
                reasons.append(part)
    if mixed and MIXED not in reasons:
        reasons.append(MIXED)
    out["sampling_unsupported"] = "; ".join(reasons) or None
    sources: list[str] = []
    for r in rows:
        v = r.get("sampling_source")
        if v and v not in sources:
            sources.append(v)
    out["sampling_source"] = "; ".join(sources) or None
    return out


def source_kind(source: str | None) -> str | None:
    """The kind of a ``sampling_source`` value (one of SOURCES), None for null or a joined mix."""
    if not source or "; " in source:
        return None
    kind = source.split(":", 1)[0].strip()
    return kind if kind in SOURCES else None


_REQUEST_KEYS = tuple(f'"{k}"' for k in PARAMS)


def request_params(request: str | None) -> dict[str, Any]:
    """The sampling parameters a request body (JSON text) set itself, normalised; unset ones
    None. Logs of schema v2 recorded no sampling columns: this is what reconstruction falls back
    to for them. Requests naming none of the keys (most harnesses) are not parsed."""
    none = dict.fromkeys(PARAMS)
    if not request or not any(k in request for k in _REQUEST_KEYS):
        return none
    try:
        body = json.loads(request)
    except json.JSONDecodeError:
        return none
    if not isinstance(body, dict):
        return none
    n = normalise(*(body.get(k) for k in PARAMS))
    if n["temperature"] == 0.0:  # greedy: the others are known (irrelevant) too
        return n
    return {k: n[k] if body.get(k) is not None else None for k in PARAMS}
