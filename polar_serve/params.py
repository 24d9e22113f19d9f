"""Request fields -> SamplingParams, with the servers' defaults and their validation messages.

Both servers fill unset temperature/top_p/top_k/min_p from the model's generation_config.json
(vLLM `--generation-config auto`, SGLang `to_sampling_params`: "user value > model
generation_config > OpenAI defaults").
"""
from __future__ import annotations

from polar_contracts.chat.render import RequestError

from .model import SamplingParams


def param_error(message: str, param: str, value=None, with_value: bool = True) -> RequestError:
    """A 400 about one request field; vLLM (VLLMValidationError) names it in `param` and suffixes the
    message with `(parameter=..., value=...)` (the dialect decides: Dialect.param_error)."""
    e = RequestError(message)
    e.param, e.value, e.with_value = param, value, with_value
    return e


def _num(body: dict, key: str, kind=float, lo=None, hi=None):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise RequestError(f"'{key}' must be {'an integer' if kind is int else 'a number'} (got {v!r})")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"'{key}' must be in [{lo}, {hi}] (got {v})")
    return kind(v)


def stop_list(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise RequestError("'stop' must be a string or a list of strings")


def sampling_params(body: dict, gen_defaults: dict, max_len: int, prompt_len: int, chat: bool) -> SamplingParams:
    t = body.get("temperature")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and t < 0:
        raise param_error(f"temperature must be non-negative, got {float(t)}.", "temperature", float(t))
    temperature = _num(body, "temperature", float, 0.0, 2.0)
    top_p = _num(body, "top_p", float, 0.0, 1.0)
    top_k = _num(body, "top_k", int, -1)
    min_p = _num(body, "min_p", float, 0.0, 1.0)
    seed = _num(body, "seed", int)
    mt = body.get("max_completion_tokens") if chat else None
    if mt is None:
        mt = body.get("max_tokens")
    if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
        raise param_error(f"max_tokens must be at least 1, got {mt}.", "max_tokens", mt)
    room = max_len - prompt_len
    if room <= 0:
        raise param_error(
            f"This model's maximum context length is {max_len} tokens. However, your prompt contains "
            f"{prompt_len} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt.", "input_tokens", prompt_len)
    if mt is None:
        mt = room if chat else 16
    mt = min(mt, room)
    lp = body.get("logprobs")
    if chat:
        top = _num(body, "top_logprobs", int, 0, 20) or 0
        if top and not lp:
            raise param_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs",
                              with_value=False)
    else:
        top = 0 if lp is None or lp is False else _num(body, "logprobs", int, 0, 20)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(x, int) for x in stop_ids):
        raise RequestError("'stop_token_ids' must be a list of integers")
    return SamplingParams(
        temperature=temperature if temperature is not None else float(gen_defaults.get("temperature", 1.0)),
        top_p=top_p if top_p is not None else float(gen_defaults.get("top_p", 1.0)),
        top_k=top_k if top_k is not None else int(gen_defaults.get("top_k", -1)),
        min_p=min_p if min_p is not None else float(gen_defaults.get("min_p", 0.0)),
        max_tokens=int(mt), seed=seed, stop_token_ids=tuple(stop_ids),
        ignore_eos=bool(body.get("ignore_eos", False)), top_logprobs=int(top or 0))
