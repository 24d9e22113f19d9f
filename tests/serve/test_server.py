"""End-to-end: a real polar-serve subprocess per dialect, checked with the openai client's types,
the golden layouts of layouts.py, the real tokenizer's chat template and a direct forward pass."""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from polar_serve.model import ServedModel
from tests.serve import layouts as L
from tests.support.servers import polar_serve

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "harness-requests"
SCRIPT = HERE / "data" / "script_with_sampling.json"
NAME = "fake-model"
SAMPLE = "POLAR-SAMPLE"  # the test script lets the model sample when a message contains this


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def srv(request, tiny_model):
    with polar_serve(tiny_model, request.param, script=SCRIPT,
                     extra_args=["--served-model-name", NAME, "--threads", "1"]) as h:
        h.dialect = request.param
        yield h


@pytest.fixture(scope="module")
def ref_model(tiny_model):
    return ServedModel(tiny_model)


def _post(srv, path, body, headers=None):
    return httpx.post(srv.base_url + path, json=body, headers=headers, timeout=120)


def _stream(srv, path, body, headers=None):
    """Parsed SSE data events (dicts), plus named events as ("event", name, dict)."""
    out, event = [], None
    with httpx.stream("POST", srv.base_url + path, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
                if data == "[DONE]":
                    out.append("[DONE]")
                elif event:
                    out.append(("event", event, json.loads(data)))
                    event = None
                else:
                    out.append(json.loads(data))
    assert out[-1] == "[DONE]"
    return out[:-1]


def _sampled_body(stream=False, **kw):
    body = {"model": NAME, "messages": [{"role": "user", "content": f"{SAMPLE} say something"}],
            "max_tokens": 6, "temperature": 0.7, "top_p": 1.0, "top_k": -1, "seed": 5, "logprobs": True,
            "top_logprobs": 2, "stream": stream, "chat_template_kwargs": {"enable_thinking": False}}
    body.update(kw)
    return body


def _ids_flags(dialect):
    return {"return_token_ids": True} if dialect == "vllm" else {"return_token_ids": True,
                                                                "return_prompt_token_ids": True}


def _choice_ids(dialect, d):
    c = d["choices"][0]
    if dialect == "vllm":
        return d["prompt_token_ids"], c["token_ids"]
    return c["prompt_token_ids"], c["response_token_ids"]


def _expected_prompt(ref_model, dialect, body):
    from polar_contracts.chat.render import render_rules, template_messages, template_tools
    msgs = template_messages(body["messages"], render_rules(dialect))
    tools = template_tools(body.get("tools"), body.get("tool_choice", "auto"), render_rules(dialect))
    out = ref_model.tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=True,
                                                  **(body.get("chat_template_kwargs") or {}))
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check_logprobs(ref_model, prompt, ids, entries, temperature):
    """Against transformers' own Qwen3 forward (not polar-serve's runner); lm_head only where needed."""
    with torch.inference_mode():
        hidden = ref_model.hf.model(input_ids=torch.tensor([prompt + ids])).last_hidden_state[0]
        logits = ref_model.hf.lm_head(hidden[len(prompt) - 1:-1])
    lp = torch.log_softmax(logits / temperature, -1)
    assert len(entries) == len(ids)
    for i, (tid, e) in enumerate(zip(ids, entries, strict=True)):
        assert e["logprob"] == pytest.approx(float(lp[i, tid]), abs=2e-4)
        assert e["token"] == ref_model.tokenizer.decode([tid])


# -- non-streaming chat ----------------------------------------------------------------------------
def test_chat_layout_ids_text_and_logprobs(srv, ref_model):
    body = _sampled_body(**_ids_flags(srv.dialect))
    r = _post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    d = r.json()
    ChatCompletion.model_validate(d)
    c = d["choices"][0]
    if srv.dialect == "vllm":
        assert list(d) == L.VLLM_CHAT and list(c) == L.VLLM_CHOICE and list(c["message"]) == L.VLLM_MESSAGE
        assert list(c["logprobs"]["content"][0]) == L.VLLM_LOGPROB and d["model"] == NAME
    else:
        assert list(d) == L.SGL_CHAT and list(c) == L.SGL_CHOICE + ["prompt_token_ids", "response_token_ids"]
        assert list(c["message"]) == L.SGL_MESSAGE and list(c["logprobs"]["content"][0]) == L.SGL_LOGPROB
        assert list(d["usage"]) == L.SGL_USAGE
    prompt, ids = _choice_ids(srv.dialect, d)
    assert prompt == _expected_prompt(ref_model, srv.dialect, body)
    assert len(ids) == d["usage"]["completion_tokens"] and len(prompt) == d["usage"]["prompt_tokens"]
    # Thinking off and no tools: the whole decoded completion is the content.
    assert ref_model.tokenizer.decode(ids, skip_special_tokens=True) == (c["message"]["content"] or "")
    _check_logprobs(ref_model, prompt, ids, c["logprobs"]["content"], 0.7)
    assert all(len(e["top_logprobs"]) == 2 for e in c["logprobs"]["content"])
    assert r.headers["x-polar-weight-version"]


def test_n_choices_non_streaming(srv):
    d = _post(srv, "/v1/chat/completions", _sampled_body(n=3, max_tokens=4, **_ids_flags(srv.dialect))).json()
    ChatCompletion.model_validate(d)
    assert [c["index"] for c in d["choices"]] == [0, 1, 2]
    key = "token_ids" if srv.dialect == "vllm" else "response_token_ids"
    ids = [c[key] for c in d["choices"]]
    assert d["usage"]["completion_tokens"] == sum(map(len, ids)) == 12
    one = _post(srv, "/v1/chat/completions", _sampled_body(seed=6, max_tokens=4, **_ids_flags(srv.dialect))).json()
    assert one["choices"][0][key] == ids[1]  # choice i is seeded with seed + i


def test_n_choices_streaming(srv):
    """n>1 streams: every chunk carries one choice by index; per index the same tokens and text
    as the non-streaming n>1 answer; usage counts the prompt once and adds the completions."""
    body = _sampled_body(n=3, max_tokens=4, stream=True, stream_options={"include_usage": True})
    headers = None
    if srv.dialect == "vllm":
        body["return_token_ids"] = True
    else:
        headers = {"x-sglext-return-output-ids": "1"}
    chunks = _stream(srv, "/v1/chat/completions", body, headers)
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    full = _post(srv, "/v1/chat/completions", _sampled_body(n=3, max_tokens=4, **_ids_flags(srv.dialect))).json()
    key = "token_ids" if srv.dialect == "vllm" else "response_token_ids"
    want_ids = [c[key] for c in full["choices"]]
    ids, text, finish = {i: [] for i in range(3)}, {i: "" for i in range(3)}, {}
    for c in chunks:
        assert len(c["choices"]) <= 1
        for ch in c["choices"]:
            ids[ch["index"]] += ch.get("token_ids") or []
            text[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"]:
                finish[ch["index"]] = ch["finish_reason"]
    if srv.dialect == "vllm":
        assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]  # the role chunks come first
        assert all(c["prompt_token_ids"] == full["prompt_token_ids"] for c in chunks[:3])
    else:
        ids = dict(enumerate(next(c["sglext"]["output_ids"] for c in chunks if c.get("sglext"))))
    assert [ids[i] for i in range(3)] == want_ids
    assert [text[i] for i in range(3)] == [c["message"]["content"] or "" for c in full["choices"]]
    assert finish == {i: c["finish_reason"] for i, c in enumerate(full["choices"])}
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == sum(map(len, want_ids)) == 12
    assert usage["prompt_tokens"] == full["usage"]["prompt_tokens"]


def test_tokens_as_token_ids(srv):
    d = _post(srv, "/v1/chat/completions", _sampled_body(return_tokens_as_token_ids=True, max_tokens=3)).json()
    toks = [e["token"] for e in d["choices"][0]["logprobs"]["content"]]
    assert toks and all(t.startswith("token_id:") and t[9:].isdigit() for t in toks)


# -- streaming chat --------------------------------------------------------------------------------
def _stream_ids(srv, body, headers=None):
    chunks = _stream(srv, "/v1/chat/completions", body, headers)
    data = [c for c in chunks if isinstance(c, dict)]
    for c in data:
        ChatCompletionChunk.model_validate(c)
    ids, lps, text = [], [], ""
    prompt = None
    for c in data:
        for ch in c["choices"]:
            ids += ch.get("token_ids") or []
            lps += (ch.get("logprobs") or {}).get("content") or []
            text += ch["delta"].get("content") or ""
    if srv.dialect == "vllm":
        prompt = data[0]["prompt_token_ids"]
    else:
        ext = [c for c in chunks if isinstance(c, tuple)] or [c for c in data if c.get("sglext")]
        sg = ext[0][2]["sglext"] if isinstance(ext[0], tuple) else ext[0]["sglext"]
        prompt, ids = sg["input_ids"], sg["output_ids"][0]
    return chunks, prompt, ids, lps, text


def test_stream_equals_non_stream_and_layout(srv, ref_model):
    body = _sampled_body(stream=True, stream_options={"include_usage": True})
    headers = None
    if srv.dialect == "vllm":
        body["return_token_ids"] = True
    else:
        headers = {"x-sglext-return-input-ids": "1", "x-sglext-return-output-ids": "1"}
    chunks, prompt, ids, lps, text = _stream_ids(srv, body, headers)
    full = _post(srv, "/v1/chat/completions", _sampled_body(**_ids_flags(srv.dialect))).json()
    fp, fids = _choice_ids(srv.dialect, full)
    assert (prompt, ids) == (fp, fids)            # same seed, same tokens, both paths
    full_lps = full["choices"][0]["logprobs"]["content"]
    assert [e["logprob"] for e in lps] == pytest.approx([e["logprob"] for e in full_lps])
    assert text == (full["choices"][0]["message"]["content"] or "")
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(ids)
    if srv.dialect == "vllm":
        assert list(chunks[0]) == L.VLLM_FIRST_CHUNK
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(list(c) == L.VLLM_CHUNK for c in chunks[1:-1])
        assert list(usage) == L.VLLM_USAGE_CHUNK
        assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert all(list(c) == L.SGL_CHUNK for c in chunks if c["choices"])  # no tools: all sse_utils chunks
        assert list(usage) == L.SGL_MODEL_CHUNK
        assert all(list(c["choices"][0]) == L.SGL_STREAM_CHOICE and list(c["choices"][0]["delta"]) in L.SGL_DELTAS
                   for c in chunks if c["choices"])
        assert chunks[-2]["sglext"]["output_ids"] == [ids]  # sglext before usage


def test_sglext_request_fields_and_framed_event(srv):
    body = _sampled_body(stream=True, return_output_ids_in_sglext=True, return_input_ids_in_sglext=True)
    chunks = _stream(srv, "/v1/chat/completions", body, {"x-sglext-ids-framed": "1"})
    named = [c for c in chunks if isinstance(c, tuple)]
    if srv.dialect != "sglang":  # sglext is SGLang's extension: vLLM ignores the fields and header
        assert named == [] and not any("sglext" in c for c in chunks if isinstance(c, dict))
        return
    assert len(named) == 1 and named[0][1] == "sglext_ids"
    assert set(named[0][2]["sglext"]) == {"input_ids", "output_ids"}


# -- scripted harness replay -----------------------------------------------------------------------
@pytest.mark.parametrize("harness", ["qwen-code", "pi"])
def test_scripted_replay_of_recorded_harness_requests(srv, ref_model, harness):
    bodies = [json.loads(x)["body"] for x in (FIXTURES / f"{harness}.jsonl").read_text().splitlines()]
    shell = "run_shell_command" if harness == "qwen-code" else "bash"
    for i, body in enumerate(bodies):
        body = dict(body, logprobs=True)
        if srv.dialect == "vllm":
            body["return_token_ids"] = True
            chunks, prompt, ids, lps, _ = _stream_ids(srv, body)
        else:
            chunks, prompt, ids, lps, _ = _stream_ids(srv, body, {"x-sglext-return-input-ids": "1",
                                                                  "x-sglext-return-output-ids": "1"})
        data = [c for c in chunks if isinstance(c, dict) and c["choices"]]
        finish = [c["choices"][0]["finish_reason"] for c in data if c["choices"][0]["finish_reason"]]
        calls = [tc for c in data for tc in (c["choices"][0]["delta"].get("tool_calls") or [])]
        rkey = "reasoning" if srv.dialect == "vllm" else "reasoning_content"
        reasoning = "".join(c["choices"][0]["delta"].get(rkey) or "" for c in data)
        args = "".join(tc["function"].get("arguments") or "" for tc in calls)
        if i < 2:
            assert finish == ["tool_calls"] and calls[0]["function"]["name"] == shell
            assert json.loads(args)["command"] in ("echo hi > hello.txt", "cat hello.txt")
            # The name first (vLLM: no arguments key; SGLang: ""), then the arguments in fragments.
            assert calls[0]["function"] == ({"name": shell} if srv.dialect == "vllm" else
                                            {"name": shell, "arguments": ""})
            assert len([tc for tc in calls if tc["function"].get("arguments")]) > 3
            assert {tc["index"] for tc in calls} == {0}
        else:
            assert finish == ["stop"] and not calls
        assert reasoning.strip()
        assert prompt == _expected_prompt(ref_model, srv.dialect, body)
        assert ids[-1] == 151645  # <|im_end|> closes every scripted turn
        # No temperature in the recorded request: generation_config's 0.6 applies (both servers).
        # (A reference forward of a ~17k-token prompt costs seconds: check the first call of a long one.)
        if i == 0 or len(prompt) < 4000:
            _check_logprobs(ref_model, prompt, ids, lps, body.get("temperature", 0.6))
        # Non-streaming: same ids, tool calls in the message.
        nb = dict(body, stream=False, **_ids_flags(srv.dialect))
        nb.pop("stream_options", None)
        resp = _post(srv, "/v1/chat/completions", nb)
        assert resp.headers["x-polar-script-turn"] == ["turn 0", "turn 1", "fallback"][i]
        full = resp.json()
        ChatCompletion.model_validate(full)
        assert _choice_ids(srv.dialect, full) == (prompt, ids)
        msg = full["choices"][0]["message"]
        assert bool(msg.get("tool_calls")) == (i < 2)
        if i < 2:
            tc = msg["tool_calls"][0]
            assert tc["function"]["arguments"] == args  # the fragments add up to the message's arguments
            assert tc["id"].startswith("chatcmpl-tool-" if srv.dialect == "vllm" else "call_")
            assert full["choices"][0]["finish_reason"] == "tool_calls"


# -- errors ----------------------------------------------------------------------------------------
def _error_shape(dialect, r, status):
    assert r.status_code == status, r.text
    d = r.json()
    if dialect == "vllm":
        assert set(d) == {"error"} and d["error"]["code"] == status and d["error"]["message"]
        return d["error"]["message"]
    assert d["object"] == "error" and d["code"] == status
    return d["message"]


def test_bad_requests_get_400_and_the_server_keeps_serving(srv):
    r = httpx.post(srv.base_url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert "not valid JSON" in _error_shape(srv.dialect, r, 400)
    r = _post(srv, "/v1/chat/completions", {"model": NAME, "messages": "hi"})
    assert "messages" in _error_shape(srv.dialect, r, 400)
    r = _post(srv, "/v1/chat/completions", _sampled_body(max_tokens=0))
    assert "max_tokens" in _error_shape(srv.dialect, r, 400)
    r = _post(srv, "/v1/chat/completions", _sampled_body(temperature="hot"))
    assert "temperature" in _error_shape(srv.dialect, r, 400)
    if srv.dialect == "vllm":
        r = _post(srv, "/v1/chat/completions", dict(_sampled_body(), model="other"))
        assert "does not exist" in _error_shape("vllm", r, 404)
    else:
        r = _post(srv, "/v1/chat/completions", dict(_sampled_body(), model="other", max_tokens=2))
        assert r.status_code == 200 and r.json()["model"] == "other"  # SGLang echoes any name
        for flag in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
            r = _post(srv, "/v1/chat/completions", _sampled_body(stream=True, **{flag: True}))
            assert flag in _error_shape("sglang", r, 400)
    assert _post(srv, "/v1/chat/completions", _sampled_body(max_tokens=2)).status_code == 200


# -- concurrency -----------------------------------------------------------------------------------
def test_concurrent_streams_do_not_mix(srv):
    bodies = [_sampled_body(stream=True, seed=100 + i, max_tokens=5, return_token_ids=srv.dialect == "vllm")
              for i in range(4)]
    headers = None if srv.dialect == "vllm" else {"x-sglext-return-output-ids": "1"}

    async def one(client, body):
        ids, out = [], []
        async with client.stream("POST", srv.base_url + "/v1/chat/completions", json=body, headers=headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    c = json.loads(line[6:])
                    out.append(c)
        for c in out:
            for ch in c["choices"]:
                ids += ch.get("token_ids") or []
            if c.get("sglext"):
                ids = c["sglext"]["output_ids"][0]
        assert len({c["id"] for c in out}) == 1
        return ids

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, b) for b in bodies))

    together = asyncio.run(main())
    alone = []
    for b in bodies:
        nb = dict(b, stream=False, **_ids_flags(srv.dialect))
        alone.append(_choice_ids(srv.dialect, _post(srv, "/v1/chat/completions", nb).json())[1])
    assert together == alone and all(len(x) == 5 for x in together)


def test_scripted_delay_does_not_block_other_requests(srv):
    body = {"model": NAME, "messages": [{"role": "user", "content": "POLAR-DELAY please"}]}

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            t0 = time.perf_counter()
            rs = await asyncio.gather(*(client.post(srv.base_url + "/v1/chat/completions", json=body)
                                        for _ in range(3)))
            return time.perf_counter() - t0, rs

    elapsed, rs = asyncio.run(main())
    assert all(r.json()["choices"][0]["message"]["content"].strip() == "slow answer" for r in rs)
    assert 1.5 <= elapsed < 4.0  # three 1.5 s replies overlap instead of queueing (4.5 s)


def test_client_disconnect_stops_the_generation(srv):
    body = _sampled_body(stream=True, max_tokens=20000, ignore_eos=True, logprobs=False, top_logprobs=0)
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break  # hang up after a few chunks
    t0 = time.perf_counter()
    r = _post(srv, "/v1/chat/completions", _sampled_body(max_tokens=2))
    assert r.status_code == 200 and time.perf_counter() - t0 < 20  # 20000 tokens would take minutes


# -- other endpoints -------------------------------------------------------------------------------
def test_completions_ids_on_the_choice(srv, ref_model):
    body = {"model": NAME, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0.5, "seed": 2,
            "top_p": 1.0, "top_k": -1, "return_token_ids": True, "logprobs": 1}
    d = _post(srv, "/v1/completions", body).json()
    Completion.model_validate(d)
    c = d["choices"][0]
    if srv.dialect == "vllm":
        assert list(c) == L.VLLM_COMPLETION_CHOICE
    assert c["prompt_token_ids"] == ref_model.tokenizer.encode("The capital of France is")
    assert len(c["token_ids"]) == 4 and ref_model.tokenizer.decode(c["token_ids"]) == c["text"]
    assert len(c["logprobs"]["token_logprobs"]) == 4
    chunks = _stream(srv, "/v1/completions", dict(body, stream=True))
    for ch in chunks:
        # The SDK types streamed completions as Completion, whose finish_reason is non-null; the real
        # servers (and OpenAI) send null until the last chunk, so validate those with it filled in.
        ch2 = json.loads(json.dumps(ch))
        for x in ch2["choices"]:
            x["finish_reason"] = x["finish_reason"] or "length"
        Completion.model_validate(ch2)
    assert [ch["choices"][0]["finish_reason"] for ch in chunks][-1] == "length"
    assert chunks[0]["choices"][0]["prompt_token_ids"] == c["prompt_token_ids"]
    assert sum((ch["choices"][0]["token_ids"] for ch in chunks), []) == c["token_ids"]
    # token ids in
    d2 = _post(srv, "/v1/completions", dict(body, prompt=c["prompt_token_ids"])).json()
    assert d2["choices"][0]["token_ids"] == c["token_ids"]


def test_models_tokenize_detokenize_health(srv, ref_model):
    m = httpx.get(srv.base_url + "/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == NAME
    assert httpx.get(srv.base_url + "/health").status_code == 200
    msgs = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    t = _post(srv, "/tokenize", msgs).json()
    assert t["tokens"] == _expected_prompt(ref_model, srv.dialect, msgs) and t["count"] == len(t["tokens"])
    detok = _post(srv, "/detokenize", {"tokens": t["tokens"]}).json()
    assert detok["prompt"] == ref_model.tokenizer.decode(t["tokens"])
    assert _post(srv, "/detokenize", {"tokens": [-1]}).status_code == 400


def test_sglang_generate_and_reload_weight_version(srv, tiny_model):
    if srv.dialect != "sglang":
        v0 = httpx.get(srv.base_url + "/polar/weight_version").json()["weight_version"]
        r = _post(srv, "/polar/reload", {"model": str(tiny_model)})
        assert r.status_code == 200 and r.json()["weight_version"] != v0
        assert _post(srv, "/v1/chat/completions", _sampled_body(max_tokens=1)).headers[
            "x-polar-weight-version"] == r.json()["weight_version"]
        assert _post(srv, "/polar/reload", {"model": "/nonexistent"}).status_code == 400
        return
    body = {"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0.5, "sampling_seed": 1},
            "return_logprob": True}
    d = _post(srv, "/generate", body).json()
    assert len(d["output_ids"]) == 4 and len(d["meta_info"]["output_token_logprobs"]) == 4
    lp, tid, txt = d["meta_info"]["output_token_logprobs"][0]
    assert tid == d["output_ids"][0] and txt is None and lp <= 0
    chunks = _stream(srv, "/generate", dict(body, stream=True))
    assert chunks[-1]["output_ids"] == d["output_ids"]  # cumulative
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4]
    r = _post(srv, "/polar/reload", {"model": str(tiny_model), "weight_version": "step-7"})
    assert r.json()["weight_version"] == "step-7"
    assert _post(srv, "/generate", body).json()["meta_info"]["weight_version"] == "step-7"
