"""The sampling a call's server actually applied (sans-IO): the row's ``temperature``, ``top_p``,
``top_k``, ``min_p`` and ``sampling_unsupported`` columns (log schema v3; rules and spelling in
polar_contracts/sampling_fields.py), and the fields the proxy fills in so that what it records is what the
server applied.

Why the proxy must know the defaults. Harnesses (Pi, Claude Code, Codex, ...) send no sampling
fields, and both servers then apply the served model's ``generation_config.json`` to every field the
request leaves unset (Qwen3: T=0.6, top_k=20, top_p=0.95):
- vLLM 0.32 (``--generation-config auto``, the default; ``ModelConfig.get_diff_sampling_param``)
  reads repetition/presence/frequency_penalty, temperature, top_k, top_p, min_p (and
  max_new_tokens) from it; ``ChatCompletionRequest.to_sampling_params``: "user -> server default ->
  OpenAI default" (T=1, top_p=1, top_k=0 i.e. off, min_p=0, penalties neutral).
  ``--generation-config vllm`` applies none of them.
- SGLang 0.5.23 (``--sampling-defaults model``, the default; ``ModelConfig.
  get_default_sampling_params``) reads repetition_penalty, temperature, top_k, top_p, min_p;
  ``serving_chat`` passes them to ``to_sampling_params``: "user value > model generation_config >
  OpenAI defaults" (T=1, top_p=1, top_k=-1, min_p=0, repetition_penalty=1).
  ``--sampling-defaults openai`` applies none.
Neither server says in its answer what it applied.

How the proxy learns them: without the option, by asking the server at first contact which model
it serves (addon/sampling_discovery.py: vLLM's ``/v1/models`` ``root``, SGLang's ``/model_info``
``model_path``) and reading that directory's generation_config.json where the proxy can; with it
(it wins over discovery): the option ``polar_generation_config``
names the served model's directory or its ``generation_config.json`` (``none``: the server applies
no model defaults, vLLM ``--generation-config vllm`` / SGLang ``--sampling-defaults openai``), read
once at configure (an unreadable one is an options error), AND the proxy writes every sampling
field the request left unset into the request it forwards, with that default. So the recorded
value is the value the server applied whatever the server's own configuration: a server started
with other defaults (or an override) receives explicit values and uses them. When the option
names the config the server itself loads, the forwarded request samples exactly as the harness's
would have; nothing the harness sees changes. When neither says, a field the request leaves unset
is recorded null (unknown), the row's ``sampling_source`` says why (``unknown: ...``) and the proxy
warns once, naming the option: never a guess.

``sampling_unsupported``: what the four parameters cannot reproduce, from vLLM 0.32's
SamplingParams / ChatCompletionRequest and SGLang 0.5.23's request fields: penalties not neutral
(the request's or the model default's), ``logit_bias``, structured output (``response_format``
json_schema / json_object / structural_tag, ``structured_outputs``, vLLM's ``guided_*``, SGLang's
``regex`` / ``ebnf`` / ``json_schema``), ``tool_choice`` "required" or a named function (both
servers constrain the output with a grammar then), ``allowed_token_ids``, ``bad_words``,
``min_tokens`` > 0 (SGLang ``min_new_tokens``: end-of-sequence masked), ``thinking_token_budget``
(vLLM forces the end of reasoning), ``use_beam_search``, ``vllm_xargs`` / ``custom_logit_processor``
/ ``custom_params`` (custom logits processors), ``watermarking``/``watermark`` on. A ``seed`` fixes
the draws, not the distribution (also with ``n`` > 1: each choice samples the same distribution),
so it is no reason. Without the option, a request that sets all four parameters but not the
penalties gets the reason ``UNKNOWN_PENALTIES`` (a model default may apply one). Greedy (T < 1e-5)
is recorded as temperature 0.0 with the truncations off.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from polar_contracts.sampling_fields import PARAMS, normalise

# The generation_config.json keys a server applies to unset request fields (vLLM reads all of
# them, SGLang all but presence/frequency_penalty; the proxy fills them in explicitly, so the
# server applies exactly these whatever it reads itself).
DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                "frequency_penalty")
# OpenAI's (and both servers') values when neither the request nor the model says anything.
NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
           "presence_penalty": 0.0, "frequency_penalty": 0.0}
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
UNKNOWN_PENALTIES = "penalty defaults unknown (set polar_generation_config)"
NONE = "none"  # the option's value for "the server applies no model defaults"

# Every top-level request key `resolve` reads (the proxy's fast path reads only these; jsonhead.py).
REQUEST_KEYS = (*DEFAULT_KEYS, "logit_bias", "response_format", "structured_outputs", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                "structural_tag", "regex", "ebnf", "json_schema", "tool_choice", "allowed_token_ids",
                "bad_words", "min_tokens", "min_new_tokens", "thinking_token_budget", "use_beam_search",
                "vllm_xargs", "custom_logit_processor", "custom_params", "watermarking", "watermark")


class GenerationConfigError(ValueError):
    """A ``polar_generation_config`` that cannot be used; the message names the path and why."""


@dataclass(frozen=True)
class ModelDefaults:
    """The sampling defaults of the served model: what the server applies to unset fields."""
    values: dict[str, float | int]  # DEFAULT_KEYS the config sets
    source: str  # the path read, or "none"
    # the rows' sampling_source when these defaults fill a field (sampling_fields.SOURCES):
    # "option: <path>" (polar_generation_config) or "discovered: <how>" (sampling_discovery.py)
    origin: str = ""

    def with_origin(self, origin: str) -> ModelDefaults:
        return ModelDefaults(self.values, self.source, origin)

    def default(self, key: str) -> float | int:
        return self.values.get(key, NEUTRAL[key])


def load_generation_config(value: str) -> ModelDefaults:
    """The option's value -> ModelDefaults. ``none``: no model defaults. A directory: its
    ``generation_config.json`` (a model directory without one has no defaults, as both servers
    read it; a directory that is not a model directory is an error). A file: that JSON."""
    if value.strip().lower() == NONE:
        return ModelDefaults({}, NONE)
    path = os.path.expanduser(value)
    if os.path.isdir(path):
        gen = os.path.join(path, "generation_config.json")
        if not os.path.exists(gen):
            if os.path.exists(os.path.join(path, "config.json")):
                return ModelDefaults({}, path)  # a model without sampling defaults
            raise GenerationConfigError(
                f"polar_generation_config {value!r}: a directory with neither generation_config.json nor "
                f"config.json (not a model directory)")
        path = gen
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except OSError as exc:
        raise GenerationConfigError(f"polar_generation_config {value!r}: cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise GenerationConfigError(f"polar_generation_config {value!r}: {path} is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise GenerationConfigError(f"polar_generation_config {value!r}: {path} is not a JSON object")
    values: dict[str, float | int] = {}
    for k in DEFAULT_KEYS:
        v = cfg.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise GenerationConfigError(f"polar_generation_config {value!r}: {path}: {k} is {v!r}, not a number")
        values[k] = int(v) if k == "top_k" else float(v)
    return ModelDefaults(values, path)


@dataclass
class Resolved:
    """One request's sampling: the row's columns and the fields to add to the forwarded request."""
    columns: dict[str, Any]  # temperature, top_p, top_k, min_p, sampling_unsupported
    fill: dict[str, Any] = field(default_factory=dict)  # unset fields -> the server's default
    unknown: tuple[str, ...] = ()  # fields left unset with no known default (recorded null)


def _set(body: dict, key: str) -> Any:
    """The request's value of ``key``; None when absent or null (both mean unset to the servers)."""
    return body.get(key)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fmt(v: Any) -> str:
    f = _num(v)
    return repr(v) if f is None else (str(int(f)) if f == int(f) and abs(f) < 1e15 else repr(f))


def unsupported_reasons(body: dict, applied_penalties: dict[str, Any]) -> list[str]:
    """Why the four parameters do not reproduce this request's sampling distribution (empty: they
    do). ``applied_penalties``: the penalty values the server applies (the request's or the default)."""
    out: list[str] = []
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    for k in PENALTIES:
        v = applied_penalties.get(k)
        if v is not None and _num(v) != neutral[k]:
            out.append(f"{k}={_fmt(v)}" + ("" if _set(body, k) is not None else " (the model's default)"))
    if body.get("logit_bias"):
        out.append("logit_bias")
    rf = body.get("response_format")
    rf_type = rf.get("type") if isinstance(rf, dict) else None
    if rf_type not in (None, "text"):
        out.append(f"structured output (response_format {rf_type})")
    for k in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
              "structural_tag", "regex", "ebnf", "json_schema"):
        if body.get(k) not in (None, False, "", [], {}):
            out.append(f"structured output ({k})")
    tc = body.get("tool_choice")
    if tc == "required":
        out.append("tool_choice=required")
    elif isinstance(tc, dict):
        name = (tc.get("function") or {}).get("name") if isinstance(tc.get("function"), dict) else tc.get("name")
        out.append(f"tool_choice={name or json.dumps(tc, sort_keys=True)}")
    if body.get("allowed_token_ids"):
        out.append("allowed_token_ids")
    if body.get("bad_words"):
        out.append("bad_words")
    for k in ("min_tokens", "min_new_tokens"):
        v = _num(body.get(k))
        if v is not None and v > 0:
            out.append(f"{k}={_fmt(v)}")
    if body.get("thinking_token_budget") is not None:
        out.append(f"thinking_token_budget={_fmt(body['thinking_token_budget'])}")
    if body.get("use_beam_search"):
        out.append("use_beam_search")
    for k in ("vllm_xargs", "custom_logit_processor", "custom_params"):
        if body.get(k):
            out.append(f"custom logits processor ({k})")
    for k in ("watermarking", "watermark"):
        if body.get(k):
            out.append(k)
    return out


UNKNOWN_DEFAULTS = ("the server's sampling defaults are unknown (polar_generation_config is unset and no "
                    "discovery ran); set polar_generation_config")


def resolve(body: dict, defaults: ModelDefaults | None, unknown_why: str = UNKNOWN_DEFAULTS) -> Resolved:
    """The sampling the server applies to ``body`` (a chat or completions request: after the
    Responses / Messages translation), given the served model's defaults (None: unknown, because
    ``unknown_why``, recorded in ``sampling_source``)."""
    fill: dict[str, Any] = {}
    applied: dict[str, Any] = {}
    unknown: list[str] = []
    for k in DEFAULT_KEYS:
        v = _set(body, k)
        if v is not None:
            applied[k] = v
        elif defaults is not None:
            applied[k] = fill[k] = defaults.default(k)
        else:
            applied[k] = None
            if k in PARAMS:
                unknown.append(k)
    columns = normalise(*(applied[k] for k in PARAMS))
    if columns["temperature"] == 0.0:
        unknown = []  # greedy: the truncations do not matter, they are known to be moot
    reasons = unsupported_reasons(body, {k: applied[k] for k in PENALTIES})
    if not unknown and any(applied[k] is None for k in PENALTIES):
        # the four are known, but a model default penalty (Qwen2.5's repetition_penalty 1.05) may
        # apply: the row must not claim the four reproduce the sampling
        reasons.append(UNKNOWN_PENALTIES)
    columns["sampling_unsupported"] = "; ".join(reasons) or None
    if unknown:
        columns["sampling_source"] = f"unknown: {unknown_why}"
    elif any(k in fill for k in PARAMS):
        columns["sampling_source"] = (defaults.origin if defaults is not None and defaults.origin
                                      else f"option: {defaults.source}" if defaults is not None else None)
    else:
        columns["sampling_source"] = "request"
    return Resolved(columns, fill, tuple(unknown))


UNKNOWN_COLUMNS = {**dict.fromkeys(PARAMS), "sampling_unsupported": None, "sampling_source": None}
