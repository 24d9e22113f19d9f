"""The addon in a real mitmdump in front of polar-serve (the tiny Qwen3 with the real tokenizer),
for every API x dialect x streaming combination, and the recorded real harness requests."""
from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from tokenizers import Tokenizer

from polar_contracts.log.reader import read_log
from tests.support.servers import polar_serve, tiny_model_dir

from .procs import REPO, mitmdump

SCRIPT = REPO / "data" / "scripts" / "create_hello.json"
FIXTURES = REPO / "tests" / "fixtures" / "harness-requests"
# Per-request values the server makes up (so two identical requests differ only in these).
VOLATILE = re.compile(rb'("id": ?"[^"]*"|"created": ?\d+)')  # response, chunk and tool-call ids


LOGPROB = re.compile(rb'"logprob": ?(-?[0-9.]+(?:e-?[0-9]+)?)')


def norm(raw: bytes) -> bytes:
    return VOLATILE.sub(lambda m: m.group(0).split(b":")[0] + b":X", raw)


def norm_lp(raw: bytes) -> bytes:
    """Also round logprob values: polar-serve's float32 math differs in the last digits between two
    identical requests (its prefix cache changes the shapes), which is not the proxy's doing."""
    return LOGPROB.sub(lambda m: b'"logprob":%.3f' % float(m.group(1)), norm(raw))


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(REPO / "data" / "tokenizers" / "qwen3" / "tokenizer.json"))


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def served(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"serve-{request.param}")
    logdir = work / "logs"
    with polar_serve(tiny_model_dir(), request.param, script=SCRIPT) as srv:
        with mitmdump(work, logdir, upstream=srv.base_url, sets={"polar_dialect": "auto"}) as px:
            model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            yield request.param, srv, px, logdir, model


def call(url, body, episode=None, stream=False):
    headers = {"x-polar-episode": episode} if episode else {}
    with httpx.Client(timeout=120) as c:
        if stream:
            with c.stream("POST", url, json=body, headers=headers) as r:
                return r.status_code, b"".join(r.iter_raw())
        r = c.post(url, json=body, headers=headers)
        return r.status_code, r.content


def harness_text(api, raw: bytes, stream: bool) -> tuple[str, str]:
    """(content, reasoning) the harness received."""
    if not stream:
        ch = json.loads(raw)["choices"][0]
        if api == "completions":
            return ch["text"], ""
        m = ch["message"]
        return m.get("content") or "", m.get("reasoning") or m.get("reasoning_content") or ""
    content, reasoning = [], []
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for ch in json.loads(line[6:]).get("choices") or ():
            if api == "completions":
                content.append(ch.get("text") or "")
            else:
                d = ch.get("delta") or {}
                content.append(d.get("content") or "")
                reasoning.append(d.get("reasoning") or d.get("reasoning_content") or "")
    return "".join(content), "".join(reasoning)


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_matrix_against_polar_serve(served, tokenizer, api, stream):
    dialect, srv, px, logdir, model = served
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    body = {"model": model, "max_tokens": 12, "temperature": 0, "stream": stream}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": "Please create hello.txt — ünïcode ok?"}]
    else:
        body["prompt"] = "The capital of France is"
    if stream:
        body["stream_options"] = {"include_usage": True}
    e = "m-" + uuid.uuid4().hex[:8]
    st_d, direct = call(srv.base_url + path, body, stream=stream)
    st_p, proxied = call(px.url + path, body, episode=e, stream=stream)
    assert st_d == st_p == 200, proxied[:500]
    assert norm(proxied) == norm(direct)  # identical but for the ids the server makes up per request
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert row["error"] is None, row["error"]
    assert row["dialect"] == dialect and row["status"] == 200 and row["stream"] is stream
    assert row["weight_version"] == "default"  # header (and SGLang non-stream chat: meta_info)
    # the ids in the log are the server's: ask it directly with its own flags
    flags = {"return_token_ids": True}
    if dialect == "sglang" and api == "chat":
        flags = {"return_prompt_token_ids": True, "return_token_ids": True}
    _, truth = call(srv.base_url + path, {**body, "stream": False, **flags})
    tch = json.loads(truth)
    ch = tch["choices"][0]
    assert row["prompt_ids"] == (tch.get("prompt_token_ids") or ch.get("prompt_token_ids"))
    assert row["completion_ids"] == (ch.get("token_ids") or ch.get("response_token_ids"))
    if not (dialect == "sglang" and api == "completions" and stream):  # SGLang streams no completion logprobs
        assert len(row["completion_logprobs"]) == len(row["completion_ids"])
        assert all(lp <= 0 for lp in row["completion_logprobs"])
    # the decoded ids are the text the harness got
    content, reasoning = harness_text(api, proxied, stream)
    decoded = tokenizer.decode(row["completion_ids"], skip_special_tokens=False)
    if api == "completions":
        assert decoded == content
    else:
        assert content and content in decoded and reasoning.strip() in decoded
        assert decoded.endswith("<|im_end|>")


def test_harness_logprobs_and_n_through_polar_serve(served):
    dialect, srv, px, logdir, model = served
    body = {"model": model, "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "user", "content": "hi"}]}
    _, direct = call(srv.base_url + "/v1/chat/completions", body, stream=True)
    e = "lp-" + uuid.uuid4().hex[:8]
    _, proxied = call(px.url + "/v1/chat/completions", body, episode=e, stream=True)
    assert norm_lp(proxied) == norm_lp(direct) and b'"top_logprobs":[{' in proxied
    assert read_log(logdir / f"{e}.arrow")["error"][0] is None


@pytest.mark.parametrize("harness", ["qwen-code", "pi"])
def test_replay_recorded_harness_requests(served, tokenizer, harness):
    """The real requests Qwen Code and Pi sent (80 KB, 15 tools, streamed, include_usage)."""
    dialect, srv, px, logdir, model = served
    e = f"replay-{harness}-{uuid.uuid4().hex[:6]}"
    lines = (FIXTURES / f"{harness}.jsonl").read_text().splitlines()
    for line in lines:
        rec = json.loads(line)
        body = {**rec["body"], "model": model}
        st_d, direct = call(srv.base_url + rec["path"], body, stream=True)
        st_p, proxied = call(px.url + rec["path"], body, episode=e, stream=True)
        assert st_d == st_p == 200, proxied[:300]
        assert norm(proxied) == norm(direct)
        assert b'"usage":' in proxied  # the harness asked for usage: it keeps it
    df = read_log(logdir / f"{e}.arrow")
    assert df.height == len(lines)
    for i, row in enumerate(df.iter_rows(named=True)):
        assert row["error"] is None and row["prompt_ids"] and row["completion_ids"]
        assert json.loads(row["request"]) == {**json.loads(lines[i])["body"], "model": model}
        # the tools the harness declared are in the prompt the server really tokenized
        assert "<tools>" in tokenizer.decode(row["prompt_ids"], skip_special_tokens=False)


@pytest.mark.parametrize("harness,api", [("claude-code", "messages"), ("codex", "responses")])
def test_translated_apis_are_captured(served, tokenizer, harness, api):
    """Messages / Responses requests go upstream as chat completions with the id flags; the
    harness gets its own API back (streamed), the row has the server's ids."""
    dialect, srv, px, logdir, model = served
    e = f"tr-{harness}-{uuid.uuid4().hex[:6]}"
    rec = json.loads((FIXTURES / f"{harness}.jsonl").read_text().splitlines()[0])
    body = {**rec["body"], "model": model}
    st, raw = call(px.url + rec["path"], body, episode=e, stream=True)
    assert st == 200, raw[:500]
    events = raw.decode()
    assert ("event: message_stop" in events) if api == "messages" else ("event: response.completed" in events)
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert row["api"] == api and row["error"] is None, row["error"]
    assert row["prompt_ids"] and row["completion_ids"] and row["stream"]
    assert json.loads(row["request"]) == body
