"""vLLM 0.32 shapes the capture suite found against the real server (sans-IO): the
answers below are the server's own bytes (tests/vllm/test_capture_real_vllm.py drives the real
thing). Completions with echo: with return_token_ids vLLM leaves the echoed prompt out of `text`
and `token_ids` is the completion only; with logprobs they cover prompt + completion.
Completions streams write null id keys; chat streams send empty-delta chunks for the flags. The
harness must get the answer it would have got without the flags, and the row the
server's ids, or an error."""
from __future__ import annotations

import json

import numpy as np
import pytest

from addon import call as calls
from addon import chat, completions
from addon.call_tokens import CallTokens as CallCapture
from addon.server_dialects import plan_request, strip_response
from addon.stream import StreamFilter

HEAD = '{"id":"cmpl-1","object":"text_completion","created":1796163845,"model":"polar-model","choices":['
FP = ',"system_fingerprint":"vllm-0.32.0-bc6467f3"'


def sse(events: list[str]) -> bytes:
    return b"".join(f"data: {e}\n\n".encode() for e in [*events, "[DONE]"])


def run_stream(plan, upstream: bytes, extract=completions.extract, asm=None):
    cap = CallCapture(plan)
    f = StreamFilter(cap, extract, asm or completions.Assembler())
    out = b"".join(b"".join(f(upstream[i:i + 97])) for i in range(0, len(upstream), 97)) + b"".join(f(b""))
    return cap, f, out


# Two prompts, echo, stream (max_tokens 2, greedy). Without flags: the echo chunk of each choice
# carries its prompt text and (with or without return_token_ids) its prompt_token_ids.
ECHO_DIRECT = sse([
    HEAD + '{"index":0,"text":"Hi Sunny","logprobs":null,"finish_reason":null,"stop_reason":null,'
           '"prompt_token_ids":[13048],"token_ids":null}]}',
    HEAD + '{"index":0,"text":" Sunny","logprobs":null,"finish_reason":"length","stop_reason":null,'
           '"prompt_token_ids":null,"token_ids":null}]' + FP + '}',
    HEAD + '{"index":1,"text":"Yoหลังจาก","logprobs":null,"finish_reason":null,"stop_reason":null,'
           '"prompt_token_ids":[64725],"token_ids":null}]}',
    HEAD + '{"index":1,"text":"(geometry","logprobs":null,"finish_reason":"length","stop_reason":null,'
           '"prompt_token_ids":null,"token_ids":null}]' + FP + '}',
])
# The same with logprobs 0 and return_token_ids
ECHO_FLAGGED = sse([
    HEAD + '{"index":0,"text":" Sunny","logprobs":{"text_offset":[0,2],"token_logprobs":[null,-10.190960884094238],'
           '"tokens":["Hi"," Sunny"],"top_logprobs":[null,{" Sunny":-10.190960884094238}]},"finish_reason":null,'
           '"stop_reason":null,"prompt_token_ids":[13048],"token_ids":[55038]}]}',
    HEAD + '{"index":0,"text":" Sunny","logprobs":{"text_offset":[8],"token_logprobs":[-9.849016189575195],'
           '"tokens":[" Sunny"],"top_logprobs":[{" Sunny":-9.849016189575195}]},"finish_reason":"length",'
           '"stop_reason":null,"prompt_token_ids":null,"token_ids":[55038]}]' + FP + '}',
    HEAD + '{"index":1,"text":"หลังจาก","logprobs":{"text_offset":[0,2],"token_logprobs":[null,-10.138635635375977],'
           '"tokens":["Yo","หลังจาก"],"top_logprobs":[null,{"หลังจาก":-10.138635635375977}]},"finish_reason":null,'
           '"stop_reason":null,"prompt_token_ids":[64725],"token_ids":[130200]}]}',
    HEAD + '{"index":1,"text":"(geometry","logprobs":{"text_offset":[9],"token_logprobs":[-10.16186809539795],'
           '"tokens":["(geometry"],"top_logprobs":[{"(geometry":-10.16186809539795}]},"finish_reason":"length",'
           '"stop_reason":null,"prompt_token_ids":null,"token_ids":[86828]}]' + FP + '}',
])


def _events(raw: bytes, change) -> bytes:
    """Each event of an SSE body changed by change(choice), written back as vLLM writes (compact)."""
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: {"):
            obj = json.loads(block[6:])
            for ch in obj["choices"]:
                change(ch)
            block = "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        out.append(block)
    return "\n\n".join(out).encode()


def _no_logprobs(ch):
    ch["logprobs"] = None


def _echoed(ch):
    ch["token_ids"] = None
    if ch["prompt_token_ids"] is not None:
        ch["text"] = {0: "Hi", 1: "Yo"}[ch["index"]] + ch["text"]


def test_vllm_echo_stream_restores_the_echoed_text_and_keeps_the_prompt_ids():
    plan = plan_request("completions", "vllm", {"prompt": ["Hi", "Yo"], "echo": True, "stream": True, "max_tokens": 2})
    # no logprobs: with echo they would make vLLM compute the prompt's logprobs as well
    assert plan.added == {"return_token_ids": True} and plan.echo_texts == ("Hi", "Yo")
    cap, f, out = run_stream(plan, _events(ECHO_FLAGGED, _no_logprobs))
    assert out == ECHO_DIRECT
    rows = cap.rows()
    # no logprobs, so no training row: the rows say so (an error), never a success without logprobs
    assert all(r["missing"].startswith("no logprobs: completions with echo") for r in rows)
    assert [r["completion_ids"] for r in rows] == [None, None]
    texts = [c["text"] for c in json.loads(f.response_text())["choices"]]
    assert texts == ["Hi Sunny Sunny", "Yoหลังจาก(geometry"]


def test_vllm_echo_stream_with_the_harness_logprobs():
    """The harness asked logprobs (they cover its prompt too): it keeps them; the row gets the
    completion's share."""
    plan = plan_request("completions", "vllm", {"prompt": ["Hi", "Yo"], "echo": True, "stream": True, "logprobs": 0})
    assert plan.added == {"return_token_ids": True}
    cap, f, out = run_stream(plan, ECHO_FLAGGED)
    assert out == _events(ECHO_FLAGGED, _echoed)
    rows = cap.rows()
    assert [r["missing"] for r in rows] == [None, None]
    assert [r["completion_ids"].tolist() for r in rows] == [[55038, 55038], [130200, 86828]]
    assert np.allclose(rows[0]["completion_logprobs"], [-10.190960884094238, -9.849016189575195])
    assert np.allclose(rows[1]["completion_logprobs"], [-10.138635635375977, -10.16186809539795])


WHOLE_DIRECT = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"polar-model","choices":[{"index":0,'
                b'"text":"Hi Sunny Sunny","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null,'
                b'"prompt_logprobs":null,"prompt_token_ids":null,"routed_experts":null}],"service_tier":null,'
                b'"system_fingerprint":"vllm-0.32.0-bc6467f3","usage":{"prompt_tokens":1,"total_tokens":3,'
                b'"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":null},'
                b'"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}')
WHOLE_FLAGGED = (b'{"id":"cmpl-1","object":"text_completion","created":1,"model":"polar-model","choices":[{"index":0,'
                 b'"text":" Sunny Sunny","logprobs":{"text_offset":[0,2,8],"token_logprobs":[null,-10.190960884094238,'
                 b'-9.849016189575195],"tokens":["Hi"," Sunny"," Sunny"],"top_logprobs":[null,{" Sunny":'
                 b'-10.190960884094238},{" Sunny":-9.849016189575195}]},"finish_reason":"length","stop_reason":null,'
                 b'"token_ids":[55038,55038],"prompt_logprobs":[null],"prompt_token_ids":[13048],"routed_experts":null}],'
                 b'"service_tier":null,"system_fingerprint":"vllm-0.32.0-bc6467f3","usage":{"prompt_tokens":1,'
                 b'"total_tokens":3,"completion_tokens":2,"prompt_tokens_details":null,"completion_tokens_details":null},'
                 b'"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}')


def _call(body: dict) -> calls.CapturedCall:
    c = calls.CapturedCall("e", 0, "completions", "vllm", 0.0, b"")
    sent = calls.prepare(c, json.dumps(body).encode(), {})
    return c, json.loads(sent)


def test_vllm_echo_whole_answer_through_the_call():
    c, sent = _call({"model": "polar-model", "prompt": "Hi", "echo": True, "max_tokens": 2})
    assert "logprobs" not in sent and sent["return_token_ids"] is True
    flagged = json.loads(WHOLE_FLAGGED)
    flagged["choices"][0].update(logprobs=None, prompt_logprobs=None)  # (as vLLM answers without logprobs)
    out = calls.finish_body(c, 200, json.dumps(flagged, separators=(",", ":")).encode())
    assert out == WHOLE_DIRECT  # the echoed text back
    (row,) = calls.rows(c, 1.0)
    assert row["error"].startswith("no logprobs: completions with echo") and "logprobs" in row["error"]
    assert row["completion_ids"] is None and row["completion_logprobs"] is None


def test_vllm_echo_with_the_harness_own_flags():
    """The harness asked return_token_ids and logprobs itself: nothing to restore (vLLM shows it no
    echoed text either), the prompt_logprobs are its own; the row still splits the logprobs."""
    c, sent = _call({"model": "polar-model", "prompt": "Hi", "echo": True, "max_tokens": 2, "logprobs": 0,
                     "return_token_ids": True})
    assert c.plan.added == {} and c.plan.echo_texts is None
    assert calls.finish_body(c, 200, WHOLE_FLAGGED) is None  # untouched
    (row,) = calls.rows(c, 1.0)
    assert row["error"] is None and row["completion_ids"].tolist() == [55038, 55038]
    assert np.allclose(row["completion_logprobs"], [-10.190960884094238, -9.849016189575195])


@pytest.mark.parametrize("body,why", [
    ({"prompt": [13048], "echo": True}, "token ids"),
    ({"prompt": [[13048], [64725]], "echo": True, "stream": True}, "token ids"),
    ({"prompt": "Hi", "echo": True, "max_tokens": 0}, "max_tokens 0"),
])
def test_vllm_echo_the_proxy_cannot_record_is_passed_through_and_said(body, why):
    raw = json.dumps({"model": "polar-model", **body}).encode()
    c = calls.CapturedCall("e", 0, "completions", "vllm", 0.0, b"")
    assert calls.prepare(c, raw, {}) == raw  # asks for nothing
    obj = {"choices": [{"index": 0, "text": "Hi Sunny", "logprobs": None, "prompt_logprobs": None,
                        "prompt_token_ids": None, "token_ids": None}]}
    body_out = json.dumps(obj, separators=(",", ":")).encode()
    assert calls.finish_body(c, 200, body_out) is None
    (row,) = calls.rows(c, 1.0)
    assert why in row["error"] and row["completion_ids"] is None


def test_logprob_count_that_does_not_fit_the_ids_is_an_error():
    """Never a row whose logprobs belong to other tokens (it was a note, and the row said success)."""
    plan = plan_request("completions", "vllm", {"prompt": "x"})
    cap = CallCapture(plan)
    completions.extract(cap, {"choices": [{"index": 0, "text": "ab", "prompt_token_ids": [1], "token_ids": [2, 3],
                                           "logprobs": {"token_logprobs": [-1.0]}}]})
    (row,) = cap.rows()
    assert "1 logprobs for 2 completion ids" in row["missing"] and row["completion_ids"] is None


def test_vllm_completions_stream_ids_put_back_as_null():
    """vLLM 0.32 writes "prompt_token_ids": null, "token_ids": null on every completions chunk
    when not asked; the proxy puts null back (it deleted the keys)."""
    plan = plan_request("completions", "vllm", {"prompt": "x", "stream": True})
    up = (HEAD + '{"index":0,"text":"a","logprobs":{"text_offset":[0],"token_logprobs":[-1.5],"tokens":["a"],'
          '"top_logprobs":[{"a":-1.5}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":[7,8],'
          '"token_ids":[9]}]}')
    want = (HEAD + '{"index":0,"text":"a","logprobs":null,"finish_reason":null,"stop_reason":null,'
            '"prompt_token_ids":null,"token_ids":null}]}')
    cap, _, out = run_stream(plan, sse([up]))
    assert out == sse([want])
    assert cap.rows()[0]["completion_ids"].tolist() == [9]


def test_vllm_chat_stream_empty_delta_chunks_kept_for_harness_token_ids():
    """A harness that asked return_token_ids (not logprobs) gets vLLM's chunks for tokens without
    text directly; the proxy's added logprobs must not make it drop them."""
    plan = plan_request("chat", "vllm", {"stream": True, "return_token_ids": True})
    assert plan.added == {"logprobs": True}
    head = '{"id":"c","object":"chat.completion.chunk","created":1,"model":"polar-model","choices":['
    lp = '{"content":[{"token":"","logprob":-10.16,"bytes":[],"top_logprobs":[]}]}'
    ev = lambda lps, fin: (head + '{"index":0,"delta":{},"logprobs":' + lps + ',"finish_reason":' + fin
                           + ',"token_ids":[112951]}]}')  # noqa: E731
    first = (head + '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
             '"prompt_token_ids":[1,2],"prompt_text":null}')
    cap, _, out = run_stream(plan, sse([first, ev(lp, "null"), ev(lp, '"length"')]), chat.extract, chat.Assembler())
    assert out == sse([first, ev("null", "null"), ev("null", '"length"')])
    assert cap.rows()[0]["completion_ids"].tolist() == [112951, 112951]
    assert strip_response(plan, json.loads(ev(lp, "null"))) is True


def test_vllm_chat_stream_empty_delta_chunks_dropped_with_continuous_usage():
    """With stream_options.continuous_usage_stats every chunk carries usage, also the empty-delta
    chunks only the proxy's flags caused: still dropped (later chunks' usage is cumulative)."""
    plan = plan_request("chat", "vllm", {"stream": True, "stream_options": {"continuous_usage_stats": True}})
    head = '{"id":"c","object":"chat.completion.chunk","created":1,"model":"polar-model","choices":['
    usage = ',"usage":{"prompt_tokens":19,"total_tokens":20,"completion_tokens":1}'
    empty = (head + '{"index":0,"delta":{},"logprobs":{"content":[{"token":"","logprob":-1.0,"bytes":[],'
             '"top_logprobs":[]}]},"finish_reason":null,"token_ids":[112951]}]' + usage + '}')
    cap, _, out = run_stream(plan, sse([empty]), chat.extract, chat.Assembler())
    assert out == sse([])
    assert cap.choices[0].ids.tolist() == [112951]
