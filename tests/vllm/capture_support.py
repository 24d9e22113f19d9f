"""Shared pieces of the capture suite against the REAL vLLM (tests/vllm/test_capture_*.py).

Every case sends one harness request three ways: straight to vLLM (what the harness would have
got), through the capture proxy (what it gets), and straight to vLLM again with the server's own
id and logprob flags (the truth the log row must hold). Greedy decoding, or a fixed seed where
n > 1 needs sampling, makes the three answers the same generation.

`POLAR_TEST_VLLM_URL=http://127.0.0.1:PORT` points the suite at a vLLM already running (serving the
tiny model as `polar-model`, with local_stack.VLLM_FLAGS) instead of starting one: for iterating on
these tests without the ~100 s start each time.
"""
from __future__ import annotations

import json
import os
import re
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest

from harness_recipes.node.local_stack import capture_proxy
from polar_contracts.log.reader import read_episode
from tests.conftest import VLLM_MODEL_NAME

MODEL = VLLM_MODEL_NAME
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# What legitimately differs between two identical calls to vLLM, and nothing else:
# - `"id"`: the response / chunk id (`chatcmpl-...`, `cmpl-...`) and tool-call ids
#   (`chatcmpl-tool-...`), drawn at random per request;
# - `"created"`: the request's start time in seconds.
# (`system_fingerprint` is fixed per server; logprob values are compared exactly.)
VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def norm(raw: bytes) -> bytes:
    return VOLATILE.sub(rb'"\1":"X"', raw)


def by_choice(raw: bytes) -> bytes:
    """A stream's events, stably grouped by choice index: with several choices (n > 1, several
    prompts) vLLM interleaves their chunks in whatever order its per-choice outputs arrive, which
    differs between two identical calls; the order within each choice is kept."""
    events = raw.split(b"\n\n")

    def index(ev: bytes) -> float:
        if not ev.startswith(b"data: {"):
            return float("inf")  # [DONE] and the trailing empty split stay last
        choices = json.loads(ev[6:]).get("choices") or ()
        return choices[0].get("index", 0) if choices else float("inf")  # (usage chunk: last)
    return b"\n\n".join(sorted(events, key=index))


def _merge(into: dict, d: dict) -> None:
    for k, v in d.items():
        old = into.get(k)
        if isinstance(v, str) and isinstance(old, str):
            into[k] = old + v
        elif isinstance(v, list) and isinstance(old, list):
            into[k] = old + v
        elif isinstance(v, dict) and isinstance(old, dict):
            _merge(old, v)
        elif v is not None or k not in into:
            into[k] = v


def coalesced(raw: bytes) -> dict:
    """A stream's content with its chunk boundaries taken out: per choice, every chunk merged into
    one (strings and lists joined, the last other value kept), plus the last chunk's top level."""
    choices: dict = {}
    top: dict = {}
    for obj in sse_data(norm(raw)):
        for ch in obj.pop("choices", None) or ():
            _merge(choices.setdefault(ch.get("index", 0), {}), ch)
        _merge(top, obj)
    return {"top": top, "choices": choices}


def differs_only_in_chunking(proxied: bytes, direct: bytes) -> bool:
    """vLLM's API server merges the pending outputs of a request into one chunk when its loop falls
    behind the engine (CPU contention on this machine), so where one stream's chunks end differs
    between two identical calls. True when two streams carry the same content in other chunks."""
    return proxied.startswith(b"data: ") and norm(proxied) != norm(direct) and coalesced(proxied) == coalesced(direct)


def assert_same_answer(proxied: bytes, direct: bytes, *, several_choices: bool = False) -> None:
    """The harness's bytes equal the server's less only VOLATILE; on failure, the first line that differs.

    Callers retry a pair whose streams differ only in where vLLM cut the chunks; when every retry was
    cut differently (a loaded machine), the two must still carry the same content chunk for chunk
    merged (the proxy's own pass-through is byte-exact by the sans-IO stream tests), said by a warning."""
    if differs_only_in_chunking(proxied, direct):
        warnings.warn("vLLM cut the two streams' chunks differently in every retry: compared their content "
                      "with the chunk boundaries taken out", stacklevel=2)
        return
    a, b = norm(proxied), norm(direct)
    if several_choices:
        a, b = by_choice(a), by_choice(b)
    if a != b:
        la, lb = a.split(b"\n"), b.split(b"\n")
        for i, (x, y) in enumerate(zip(la, lb)):
            if x != y:
                raise AssertionError(f"line {i} differs:\n proxy:  {x[:1500]!r}\n direct: {y[:1500]!r}")
        raise AssertionError(f"{len(la)} lines through the proxy, {len(lb)} direct:\n{a[-1500:]!r}\n{b[-1500:]!r}")


@dataclass(frozen=True)
class Upstream:
    url: str


@dataclass
class Stack:
    vllm: str  # base URL of vLLM
    proxy: str  # base URL of the capture proxy in front of it
    logdir: Path

    def rows(self, episode: str) -> list[dict]:
        return list(read_episode(self.logdir / f"{episode}.arrow").calls.iter_rows(named=True))


@pytest.fixture(scope="module")
def stack(request, tmp_path_factory):
    url = os.environ.get("POLAR_TEST_VLLM_URL")
    if not url:
        url = request.getfixturevalue("real_vllm").url
    work = tmp_path_factory.mktemp("capture")
    logdir = work / "logs"
    with capture_proxy(url, logdir, control_secret=None, confdir=work / "mitmconf", log=work / "mitmdump.log",
                       sets={"polar_dialect": "vllm"}) as px:
        yield Stack(url, px.url, logdir)


def post(url: str, body: dict, *, stream: bool = False, episode: str | None = None) -> tuple[int, bytes]:
    headers = {"x-polar-episode": episode} if episode else {}
    with httpx.Client(timeout=300) as c:
        if stream:
            with c.stream("POST", url, json=body, headers=headers) as r:
                return r.status_code, b"".join(r.iter_raw())
        r = c.post(url, json=body, headers=headers)
        return r.status_code, r.content


def new_episode(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def sse_data(raw: bytes) -> list[dict]:
    """The JSON data objects of an SSE body (without [DONE])."""
    out = []
    for block in raw.decode().split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


# ---- the truth: the server's own ids and logprobs for a request ------------------------------

@dataclass
class Truth:
    prompt_ids: list[list[int]]  # per choice
    completion_ids: list[list[int]]
    logprobs: list[list[float]] = field(default_factory=list)


def truth_body(api: str, body: dict) -> dict:
    """The same generation asked non-streaming with the server's own id/logprob flags (no echo:
    it changes only what is shown, not what is generated)."""
    t = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "echo")}
    t["return_token_ids"] = True
    if api == "chat":
        t["logprobs"] = True
    elif t.get("logprobs") is None:
        t["logprobs"] = 0
    return t


def truth(stack: Stack, api: str, body: dict) -> Truth:
    st, raw = post(stack.vllm + (CHAT if api == "chat" else COMPLETIONS), truth_body(api, body))
    assert st == 200, raw[:500]
    obj = json.loads(raw)
    choices = sorted(obj["choices"], key=lambda c: c["index"])
    if api == "chat":
        return Truth([obj["prompt_token_ids"]] * len(choices), [c["token_ids"] for c in choices],
                     [[e["logprob"] for e in c["logprobs"]["content"]] for c in choices])
    return Truth([c["prompt_token_ids"] for c in choices], [c["token_ids"] for c in choices],
                 [c["logprobs"]["token_logprobs"] for c in choices])


def assert_rows_match(rows: list[dict], t: Truth, *, logprobs: bool = True) -> None:
    """Each choice's row holds exactly the server's ids and logprobs (logprobs False: none, and a
    note says so)."""
    assert [r["choice"] for r in rows] == list(range(len(t.completion_ids)))
    for r, p, c, lp in zip(rows, t.prompt_ids, t.completion_ids, t.logprobs, strict=True):
        assert r["error"] is None, r["error"]
        assert r["prompt_ids"] == p
        assert r["completion_ids"] == c
        if not logprobs:
            assert r["completion_logprobs"] is None and any("no logprobs" in n for n in r["notes"])
            continue
        assert r["completion_logprobs"] is not None and len(r["completion_logprobs"]) == len(c)
        # float32 in the log; the server's floats are float32 logprobs written as doubles
        assert np.allclose(r["completion_logprobs"], lp, rtol=0, atol=1e-5), (r["completion_logprobs"], lp)


def assert_no_silent_wrong_row(rows: list[dict], t: Truth) -> None:
    """A row that says success carries the server's ids: never a silently wrong training row."""
    for r in rows:
        if r["error"] is None:
            i = r["choice"]
            assert r["prompt_ids"] == t.prompt_ids[i] and r["completion_ids"] == t.completion_ids[i]
