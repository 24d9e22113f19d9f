"""What an upstream's logprobs are (the rows' ``logprobs_mode``), found by probing it once.

The mode is server-wide and appears in no answer: vLLM reports ``raw`` log-probabilities (log-softmax
of the logits before temperature and truncation) unless started with ``--logprobs-mode
processed_logprobs``; SGLang 0.5.23 reports ``scaled`` ones (log-softmax of logits / T, before
top-k/top-p/min-p: sglang/srt/layers/sampler.py); polar-serve's vLLM dialect reports ``processed``
(after temperature and truncation, renormalised). So the proxy asks the upstream itself, before the
first call it forwards there: two one-token chat completions with ``top_k: 2`` and
``top_logprobs: 2``, at temperatures 1.0 and 2.0 (``PROBE_TEMPERATURES``):

- ``processed``: top-k keeps two tokens, so their two probabilities sum to 1 at both temperatures,
  and they change with the temperature;
- ``raw``: the two log-probabilities do not change with the temperature;
- ``scaled``: they change with the temperature, and (untruncated) do not sum to 1.

Asking both temperatures (not only the first when it sums to 1) keeps a confident model's raw top
two (e.g. Qwen3's ``<think>`` at p ~ 1) from passing for processed. Anything else (an error, no
top_logprobs, two equal top tokens, which look alike in every mode) is ``None``: unknown, recorded
as null, never guessed. The harness's answers do not change: the probes go to the server directly.

Sans-IO here: the probe bodies, `classify`, and `ModeCache` (per upstream: the mode, the probe in
flight, retry backoff after a failure, invalidation after a weight sync or a failed connection).
The one I/O edge, `probe_upstream`, sends the two requests (urllib on a worker thread).
"""
from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

PROBE_TEMPERATURES = (1.0, 2.0)
PROBE_MESSAGES = [{"role": "user", "content": "Say one word."}]
# |p1 + p2 - 1| of a processed top-2: float32 log-softmax over two tokens is exact to ~1e-7; a
# scaled (untruncated) top-2 misses the rest of a ~150k vocabulary at T=2, far more than this
# unless the model is sure beyond ~47 nats (then the two modes are the same distribution anyway)
SUM_TOL = 1e-5
MIN_GAP = 1e-4  # logprob gap between the top two below which the temperatures cannot be told apart
RATIO_TOL = 0.1  # |gap(T2)/gap(T1) - expected| (1 for raw, T1/T2 for processed and scaled)
PROBE_TIMEOUT = 120.0  # default seconds per probe request (option polar_probe_timeout_s): a cold CPU vLLM is slow
BACKOFF = (5.0, 15.0, 60.0, 300.0)  # seconds before retrying a failed probe, growing per failure


class ProbeError(Exception):
    """A probe answer that cannot be classified; the message says why."""


def probe_body(model: str | None, temperature: float) -> dict[str, Any]:
    """One probe request: a single token, the top two of a top-2 truncation, at ``temperature``
    (top_p and min_p off, so only top-k truncates)."""
    # (enable_thinking: Qwen3's template then starts the answer itself, where the model is less
    # sure than of "<think>"; other templates ignore the key)
    body: dict[str, Any] = {"messages": PROBE_MESSAGES, "max_tokens": 1, "logprobs": True, "top_logprobs": 2,
                            "top_k": 2, "top_p": 1.0, "min_p": 0.0, "temperature": temperature, "stream": False,
                            "chat_template_kwargs": {"enable_thinking": False}}
    if model:
        body["model"] = model
    return body


def top_two(answer: Any) -> tuple[float, float]:
    """The two top log-probabilities of a chat answer's first token."""
    try:
        content = answer["choices"][0]["logprobs"]["content"]
        tops = content[0]["top_logprobs"]
        a, b = float(tops[0]["logprob"]), float(tops[1]["logprob"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ProbeError(f"no top_logprobs in the probe's answer ({type(exc).__name__}: {exc}): "
                         f"{json.dumps(answer)[:300]}") from None
    return (a, b) if a >= b else (b, a)


def classify(first: tuple[float, float], second: tuple[float, float]) -> str | None:
    """The mode from the top two log-probabilities at the two probe temperatures (see the module
    docstring); None when they cannot tell. The gap between the two is what temperature acts on:
    raw keeps it, processed and scaled divide it by T (1.0 -> 2.0: halve it); the sum of the two
    probabilities then tells processed (1: a two-token distribution) from scaled (less)."""
    gap1, gap2 = first[0] - first[1], second[0] - second[1]
    if gap1 < MIN_GAP:
        return None  # two (nearly) equal top tokens: alike in every mode at every temperature
    ratio = gap2 / gap1
    t1, t2 = PROBE_TEMPERATURES
    if abs(ratio - 1.0) < RATIO_TOL:
        return "raw"
    if abs(ratio - t1 / t2) >= RATIO_TOL:
        return None  # neither: not a server this classifier knows
    sums = [math.exp(a) + math.exp(b) for a, b in (first, second)]
    if all(abs(s - 1.0) < SUM_TOL for s in sums):
        return "processed"
    if sums[1] < 1.0 - SUM_TOL:
        return "scaled"
    return None


@dataclass
class _Entry:
    mode: str | None = None
    known: bool = False  # a probe finished (mode may still be None: it could not tell)
    failures: int = 0
    retry_at: float = 0.0  # after a failure: no new probe before this time
    task: asyncio.Future[None] | None = None  # the probe in flight, shared by every call waiting for it
    generation: int = 0  # bumped by invalidate: a probe started before it does not count


class ModeCache:
    """Per upstream base URL: its mode, the probe in flight, and when to probe again. Time is
    passed in (sans-IO); the caller runs the probes."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def entry(self, base: str) -> _Entry:
        return self._entries.setdefault(base, _Entry())

    def mode(self, base: str) -> str | None:
        e = self._entries.get(base)
        return e.mode if e is not None else None

    def should_probe(self, base: str, now: float) -> bool:
        """No answer yet, none in flight, and not backing off after a failure."""
        e = self.entry(base)
        return not e.known and e.task is None and now >= e.retry_at

    def started(self, base: str, task: asyncio.Future[None]) -> int:
        """A probe of ``base`` is now in flight; returns the generation to hand to `done`."""
        e = self.entry(base)
        e.task = task
        return e.generation

    def done(self, base: str, generation: int, mode: str | None, now: float) -> None:
        """A probe finished: a mode, or None (it failed, or the answers could not tell): retried
        after a growing backoff. A probe older than the last invalidation only clears itself."""
        e = self.entry(base)
        if generation != e.generation:
            return  # (invalidated meanwhile: a newer probe may be in flight, leave it)
        e.task = None
        e.mode = mode
        if mode is None:
            e.retry_at = now + BACKOFF[min(e.failures, len(BACKOFF) - 1)]
            e.failures += 1
            e.known = False
        else:
            e.known, e.failures, e.retry_at = True, 0, 0.0

    def bases(self) -> list[str]:
        """Every upstream base URL with an entry."""
        return list(self._entries)

    def invalidate(self, base: str | None = None) -> None:
        """Forget the mode (one upstream, or all): the next call probes again (a weight sync, a
        restarted server after a failed connection). A probe in flight is left to finish."""
        for b, e in list(self._entries.items()):
            if base is None or b == base:
                e.mode, e.known, e.failures, e.retry_at, e.task = None, False, 0, 0.0, None
                e.generation += 1


# -- the I/O edge ------------------------------------------------------------------------------

def _post(url: str, body: dict, timeout: float, headers: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def first_model(base: str, timeout: float, headers: dict[str, str] | None = None) -> str | None:
    with urllib.request.urlopen(urllib.request.Request(base + "/v1/models", headers=headers or {}), timeout=timeout) as r:
        data = json.loads(r.read()).get("data") or []
    return data[0].get("id") if data and isinstance(data[0], dict) else None


def probe_upstream(base: str, model: str | None, timeout: float = PROBE_TIMEOUT,
                   headers: dict[str, str] | None = None) -> str | None:
    """Blocking (run it on a worker thread): probe ``base`` (scheme://host:port plus any path
    prefix before /v1) serving ``model`` (None: /v1/models' first id). Returns the mode, or None
    when the answers cannot tell; raises (OSError, ProbeError, ...) when the probe failed.
    ``headers``: e.g. the server's Authorization (never logged)."""
    url = base + "/v1/chat/completions"
    name = model or first_model(base, timeout, headers)
    try:
        first = _post(url, probe_body(name, PROBE_TEMPERATURES[0]), timeout, headers)
    except urllib.error.HTTPError as exc:
        if not model or exc.code not in (400, 404):
            raise
        # the harness's name may be one the server does not serve (a translated Messages call)
        name = first_model(base, timeout, headers)
        first = _post(url, probe_body(name, PROBE_TEMPERATURES[0]), timeout, headers)
    second = _post(url, probe_body(name, PROBE_TEMPERATURES[1]), timeout, headers)
    return classify(top_two(first), top_two(second))
