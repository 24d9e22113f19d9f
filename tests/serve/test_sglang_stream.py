"""SGLang 0.5.23 stream layout of polar-serve and the proxy's filtering of it.

From serving_chat.py `_generate_stream_content` / `_generate_chat_stream` and sse_utils.py: with a
reasoning parser configured and logprobs requested, a step whose tokens produced no text
(`<think>`, `</think>`, `<|im_end|>`) still sends its logprobs, in a chunk whose delta is
`{"reasoning_content": null}`; without logprobs there is no such chunk, so the proxy, which asks
for logprobs on the harness's behalf, drops it (addon.server_dialects.strip_response).
"""
from __future__ import annotations

import json

import httpx
import pytest

from addon.server_dialects import plan_request, strip_response
from tests.serve.test_server import NAME, SCRIPT
from tests.support.servers import polar_serve


@pytest.fixture(scope="module")
def sgl(tiny_model):
    with polar_serve(tiny_model, "sglang", script=SCRIPT, extra_args=["--served-model-name", NAME, "--threads", "1"]) as h:
        yield h


def _chunks(srv, body) -> list[dict]:
    out = []
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def _body(**kw):
    # a scripted reply (script_with_sampling.json): with thinking on the template's reply has
    # `<think>`, `</think>` and then `<|im_end|>`, the three steps without text
    body = {"model": NAME, "messages": [{"role": "user", "content": "make a file"}], "max_tokens": 64,
            "stream": True, "logprobs": True}
    body.update(kw)
    return body


def test_logprob_only_chunks_carry_each_steps_logprobs_once(sgl):
    chunks = _chunks(sgl, _body())
    first, finish = chunks[0]["choices"][0], chunks[-1]["choices"][0]
    assert first["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert finish["delta"] == {"reasoning_content": None} and finish["finish_reason"] and finish["logprobs"] is None
    assert all("usage" not in c for c in chunks)  # sse_utils chunks: omit_defaults
    steps = [c["choices"][0]["logprobs"]["content"] for c in chunks[1:-1]]
    assert all(s is not None and len(s) == 1 for s in steps)  # one step per chunk with text or not
    no_lp = _chunks(sgl, _body(logprobs=False))
    lp_only = [c for c in chunks if c["choices"][0]["delta"] == {"reasoning_content": None}
               and c["choices"][0]["finish_reason"] is None]
    texts = [c for c in chunks[1:-1] if c not in lp_only]
    # the same text chunks without logprobs, and no empty ones
    assert [c["choices"][0]["delta"] for c in no_lp[1:-1]] == [c["choices"][0]["delta"] for c in texts]
    assert len(lp_only) >= 2  # at least `</think>` and `<|im_end|>`
    assert len(steps) == len(lp_only) + len(texts)



def test_proxy_drops_logprob_only_chunks_it_caused():
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"reasoning_content": None}, "logprobs": {"content": [{"token": "<think>"}]},
         "finish_reason": None, "matched_stop": None}]}
    added = plan_request("chat", "sglang", {"stream": True, "messages": []})
    assert strip_response(added, json.loads(json.dumps(chunk))) is None
    own = plan_request("chat", "sglang", {"stream": True, "logprobs": True, "messages": []})
    assert strip_response(own, json.loads(json.dumps(chunk))) is False
    for delta, finish in (({"reasoning_content": None, "role": "assistant", "content": ""}, None),
                          ({"reasoning_content": None}, "stop"), ({"reasoning_content": "hm"}, None)):
        c = json.loads(json.dumps(chunk))
        c["choices"][0].update(delta=delta, finish_reason=finish)
        assert strip_response(added, c) is True and c["choices"][0]["logprobs"] is None
