"""Stream filters over real chunk shapes (docs/reference.md, "Wire formats"): ids captured, added fields removed,
everything else byte-identical, any chunking."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from addon import chat, completions
from addon.call_tokens import CallTokens as CallCapture
from addon.json_style import dumps_like
from addon.server_dialects import plan_request, strip_response
from addon.stream import StreamFilter


def sse(objs, nl="\n"):
    out = b""
    for o in objs:
        data = o if isinstance(o, str) else json.dumps(o, ensure_ascii=False, separators=(",", ":"))
        out += f"data: {data}{nl}{nl}".encode()
    return out


def vllm_chat_chunks(with_ids, harness_lp=False):
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    toks = [("Hé", 101, -0.5), ("llo", 102, -0.25), (" 日本", 103, -1.0)]
    lp = lambda t, lpv: {"content": [{"token": t, "logprob": lpv, "bytes": list(t.encode()), "top_logprobs": []}]}
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], "prompt_token_ids": [1, 2, 3] if with_ids else None,
             "prompt_text": None}
    out = [first]
    for t, i, lpv in toks:
        ch = {"index": 0, "delta": {"content": t}, "logprobs": lp(t, lpv) if (with_ids or harness_lp) else None,
              "finish_reason": None, "token_ids": [i] if with_ids else None}
        out.append({**head, "choices": [ch], "kv_transfer_params": None})
    out.append({**head, "choices": [{"index": 0, "delta": {}, "logprobs": lp("", -0.1) if (with_ids or harness_lp) else None,
                                     "finish_reason": "stop", "token_ids": [151645] if with_ids else None}]})
    out.append({**head, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    out.append("[DONE]")
    return out


def run(plan, extract, asm, data, cuts=()):
    cap = CallCapture(plan)
    f = StreamFilter(cap, extract, asm)
    cuts = sorted(set(c for c in cuts if 0 < c < len(data)))
    out = b""
    for a, b in zip([0, *cuts], [*cuts, len(data)]):
        got = f(data[a:b])
        assert isinstance(got, list) and b"" not in got  # b"" would end an HTTP/1 chunked body
        out += b"".join(got)
    out += b"".join(f(b""))
    return cap, f, out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=2000), max_size=8))
def test_vllm_chat_stream_any_split(cuts):
    plan = plan_request("chat", "vllm", {"stream": True, "stream_options": {"include_usage": True}})
    assert plan.added == {"logprobs": True, "return_token_ids": True}
    up = sse(vllm_chat_chunks(True))
    direct = sse(vllm_chat_chunks(False))
    cap, f, out = run(plan, chat.extract, chat.Assembler(), up, cuts)
    assert out == direct  # the harness sees exactly what the server sends without the flags
    (row,) = cap.rows()
    assert row["prompt_ids"].tolist() == [1, 2, 3]
    assert row["completion_ids"].tolist() == [101, 102, 103, 151645]
    assert np.allclose(row["completion_logprobs"], [-0.5, -0.25, -1.0, -0.1])
    assert row["finish_reason"] == "stop" and row["missing"] is None
    assert json.loads(f.response_text())["choices"][0]["message"]["content"] == "Héllo 日本"


def test_vllm_empty_delta_chunks():
    """With return_token_ids or logprobs vLLM also sends chunks for tokens without text; without
    them it skips those tokens. Dropped only when the harness did not ask for logprobs."""
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    e = lambda t, lpv: {"token": t, "logprob": lpv, "bytes": [], "top_logprobs": []}
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}], "prompt_token_ids": [1], "prompt_text": None}
    empty = {**head, "choices": [{"index": 0, "delta": {}, "logprobs": {"content": [e("<x>", -1.0)]},
                                  "finish_reason": None, "token_ids": [7]}], "kv_transfer_params": None}
    text = {**head, "choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": {"content": [e("a", -2.0)]},
                                 "finish_reason": None, "token_ids": [8]}], "kv_transfer_params": None}
    up = sse([first, empty, text, "[DONE]"])
    nulled = lambda c, lp: {**c, "choices": [{**c["choices"][0], "token_ids": None,
                                              **({} if lp else {"logprobs": None})}]}
    # the harness did not ask for logprobs: the empty chunk goes
    plan = plan_request("chat", "vllm", {"stream": True})
    cap, f, out = run(plan, chat.extract, chat.Assembler(), up)
    assert out == sse([{**first, "prompt_token_ids": None}, nulled(text, False), "[DONE]"])
    assert cap.rows()[0]["completion_ids"].tolist() == [7, 8]
    assert cap.rows()[0]["completion_logprobs"].tolist() == [-1.0, -2.0]
    # it did: vLLM sends the empty chunk to it directly too
    plan = plan_request("chat", "vllm", {"stream": True, "logprobs": True})
    cap, f, out = run(plan, chat.extract, chat.Assembler(), up)
    assert out == sse([{**first, "prompt_token_ids": None}, nulled(empty, True), nulled(text, True), "[DONE]"])


def test_harness_logprobs_kept():
    body = {"stream": True, "logprobs": True, "top_logprobs": 2}
    plan = plan_request("chat", "vllm", body)
    assert "logprobs" not in plan.added
    cap, f, out = run(plan, chat.extract, chat.Assembler(), sse(vllm_chat_chunks(True)))
    assert out == sse(vllm_chat_chunks(False, harness_lp=True))
    assert len(cap.rows()[0]["completion_logprobs"]) == 4


def test_crlf_comments_pass_byte_identical():
    plan = plan_request("chat", "vllm", {"stream": True})
    up = b": ping\r\n\r\n" + sse(vllm_chat_chunks(True), nl="\r\n")
    cap, f, out = run(plan, chat.extract, chat.Assembler(), up)
    assert out == b": ping\r\n\r\n" + sse(vllm_chat_chunks(False), nl="\r\n")
    assert cap.rows()[0]["completion_ids"].tolist() == [101, 102, 103, 151645]


def sglang_chunks(with_ids, usage):
    head = {"id": "s1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None, "matched_stop": None}]}]
    for t, lpv in [("a", -0.5), ("b", -0.7)]:
        out.append({**head, "choices": [{"index": 0, "delta": {"content": t},
                                         "logprobs": {"content": [{"token": t, "bytes": [97], "logprob": lpv,
                                                                   "top_logprobs": []}]} if with_ids else None,
                                         "finish_reason": None, "matched_stop": None}]})
    out.append({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                     "matched_stop": 151645}]})
    if with_ids:
        out.append({**head, "choices": [], "sglext": {"input_ids": [5, 6], "output_ids": [[7, 8]]}})
    if usage:
        out.append({**head, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}})
    return out + ["[DONE]"]


@pytest.mark.parametrize("usage", [False, True])
def test_sglang_sglext_chunk_dropped_usage_kept(usage):
    body = {"stream": True, **({"stream_options": {"include_usage": True}} if usage else {})}
    plan = plan_request("chat", "sglang", body)
    assert plan.added == {"logprobs": True, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}
    cap, f, out = run(plan, chat.extract, chat.Assembler(), sse(sglang_chunks(True, usage)))
    assert out == sse(sglang_chunks(False, usage))
    (row,) = cap.rows()
    assert row["prompt_ids"].tolist() == [5, 6] and row["completion_ids"].tolist() == [7, 8]
    assert row["completion_logprobs"].tolist() == pytest.approx([-0.5, -0.7])


def test_missing_ids_are_an_explicit_error():
    plan = plan_request("chat", "vllm", {"stream": True})
    cap, f, out = run(plan, chat.extract, chat.Assembler(), sse(vllm_chat_chunks(False)))
    (row,) = cap.rows()
    assert row["completion_ids"] is None and row["prompt_ids"] is None
    assert "no prompt token ids" in row["missing"] and "no completion token ids" in row["missing"]


def completions_chunks(dialect, with_ids):
    head = {"id": "k", "object": "text_completion", "created": 1, "model": "m"}
    out = []
    for j, (t, i, lpv) in enumerate([("x", 9, -0.5), ("y", 10, -0.25)]):
        ch = {"index": 0, "text": t, "logprobs": {"tokens": [t], "token_logprobs": [lpv], "top_logprobs": [None],
                                                  "text_offset": [j]} if with_ids else None,
              "finish_reason": "length" if j else None}
        if dialect == "vllm":  # vLLM 0.32 (measured): both keys on every chunk, null when not requested
            ch["stop_reason"] = None
            ch["prompt_token_ids"] = [1, 2] if with_ids and j == 0 else None
            ch["token_ids"] = [i] if with_ids else None
        elif with_ids:  # SGLang leaves the id keys out of unrequested completions chunks
            ch["token_ids"] = [i]
            if j == 0:
                ch["prompt_token_ids"] = [1, 2]
        out.append({**head, "choices": [ch]})
    return out + ["[DONE]"]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_completions_stream(dialect):
    plan = plan_request("completions", dialect, {"stream": True, "prompt": "hi"})
    assert plan.added == {"logprobs": 0 if dialect == "vllm" else 1, "return_token_ids": True}
    cap, f, out = run(plan, completions.extract, completions.Assembler(), sse(completions_chunks(dialect, True)))
    assert out == sse(completions_chunks(dialect, False))
    (row,) = cap.rows()
    assert row["prompt_ids"].tolist() == [1, 2] and row["completion_ids"].tolist() == [9, 10]
    assert json.loads(f.response_text())["choices"][0]["text"] == "xy"


def test_non_stream_strip_vllm_and_sglang():
    plan = plan_request("chat", "vllm", {})
    obj = {"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": {"content": [{"logprob": -1}]},
                                   "finish_reason": "stop", "token_ids": [4]}], "prompt_token_ids": [1]}
    cap = CallCapture(plan)
    chat.extract(cap, obj)
    assert strip_response(plan, obj) is True
    assert obj == {"id": "x", "choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": None,
                                           "finish_reason": "stop", "token_ids": None}], "prompt_token_ids": None}
    assert cap.rows()[0]["completion_ids"].tolist() == [4]
    plan = plan_request("chat", "sglang", {})
    assert plan.added == {"logprobs": True, "return_prompt_token_ids": True, "return_token_ids": True,
                          "return_meta_info": True}
    obj = {"choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": {"content": [{"logprob": -1}]},
                        "prompt_token_ids": [1], "response_token_ids": [4], "finish_reason": "stop"}]}
    cap = CallCapture(plan)
    chat.extract(cap, obj)
    strip_response(plan, obj)
    assert obj == {"choices": [{"index": 0, "message": {"content": "hi"}, "logprobs": None, "finish_reason": "stop"}]}
    r = cap.rows()[0]
    assert r["prompt_ids"].tolist() == [1] and r["completion_ids"].tolist() == [4]


def test_n_choices_get_one_row_each():
    plan = plan_request("chat", "vllm", {"n": 2})
    obj = {"prompt_token_ids": [1], "choices": [
        {"index": 0, "message": {}, "token_ids": [2], "logprobs": {"content": [{"logprob": -1}]}},
        {"index": 1, "message": {}, "token_ids": [3], "logprobs": {"content": [{"logprob": -2}]}}]}
    cap = CallCapture(plan)
    chat.extract(cap, obj)
    rows = cap.rows()
    assert [r["completion_ids"].tolist() for r in rows] == [[2], [3]]
    assert [r["choice"] for r in rows] == [0, 1]


@settings(max_examples=300)
@given(st.dictionaries(st.text(max_size=5), st.one_of(st.text(), st.integers(), st.booleans(), st.none(),
                                                       st.lists(st.text(max_size=8), max_size=3)), min_size=1, max_size=4),
       st.booleans(), st.booleans())
def test_dumps_like_reproduces_the_servers_bytes(obj, ensure_ascii, spaced):
    """capture.json_style / dumps_like: an event re-serialized "like" the server's bytes is those
    bytes again, whichever separators and escaping the server used."""
    raw = json.dumps(obj, ensure_ascii=ensure_ascii, separators=(", ", ": ") if spaced else (",", ":")).encode()
    assert dumps_like(raw)(json.loads(raw)) == raw
