"""Chat answers (vLLM and SGLang shapes) translated to the OpenAI Responses API: every event
parses as the SDK's ResponseStreamEvent, the SDK's streaming helper builds the final Response,
the non-streaming answer validates as openai.types.responses.Response, and reasoning sent back
in a later request reaches the chat history byte for byte."""
from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from polar_contracts.translate import translator_for
from tests.translate.chat_chunks import full_response, parse_sse, stream
from tests.translate.replay_server import replay

EVENT = TypeAdapter(ResponseStreamEvent)
TOOLS = [{"type": "function", "name": "exec_command", "strict": False,
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
         {"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
             {"type": "function", "name": "spawn_agent", "strict": False,
              "parameters": {"type": "object", "properties": {}}}]},
         {"type": "web_search", "external_web_access": True}]
REQUEST = {"model": "fake-model", "stream": True, "input": "create hello.txt", "tools": TOOLS,
           "tool_choice": "auto", "parallel_tool_calls": True, "store": False,
           "reasoning": {"effort": "low", "summary": "auto"},
           "include": ["reasoning.encrypted_content"]}

CASES = {
    "text": ([("text", "Hello there, how can I help?")], "stop", "completed"),
    "reasoning_text": ([("reasoning", "The user greets me.\n"), ("text", "Hi!")], "stop",
                       "completed"),
    "tool": ([("reasoning", "Use the shell."), ("text", "I'll run it."),
              ("tool", "exec_command", {"cmd": "echo hi > hello.txt"})], "tool_calls",
             "completed"),
    "two_tools": ([("tool", "exec_command", {"cmd": "ls"}), ("tool", "spawn_agent", {})],
                  "tool_calls", "completed"),
    "length": ([("reasoning", "Thinking for a long time and")], "length", "incomplete"),
}


def _new():
    t = translator_for("POST", "/v1/responses")
    t.request_to_chat(REQUEST, {})
    return t


def _view(item):
    if item.type == "reasoning":
        return ("reasoning", "".join(c.text for c in item.content or []))
    if item.type == "message":
        return ("text", "".join(c.text for c in item.content))
    return ("tool", (item.name, json.loads(item.arguments)))


def _expected(parts):
    return [(p[0], p[1]) if p[0] != "tool" else ("tool", (p[1], p[2])) for p in parts]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_events_parse_and_accumulate(case, dialect):
    parts, finish, status = CASES[case]
    t = _new()
    pieces = [t.feed_chunk(c) for c in stream(parts, dialect, finish=finish,
                                                reasoning_tokens=7)]
    pieces.append(t.finish())
    assert pieces[0].startswith(b"event: response.created\n"), "first chunk opens the response"
    data = b"".join(pieces)
    events = parse_sse(data)
    for i, (name, obj) in enumerate(events):
        assert name == obj["type"] and obj["sequence_number"] == i
        EVENT.validate_python(obj)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == ("response.completed" if status == "completed" else "response.incomplete")
    done = [o["item"] for n, o in events if n == "response.output_item.done"]
    added = [o["item"]["id"] for n, o in events if n == "response.output_item.added"]
    assert [d["id"] for d in done] == added, "every item is added and finished exactly once"
    # Codex takes function calls from output_item.done: complete name, call_id, arguments.
    calls = [d for d in done if d["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(p[1], p[2]) for p in parts if p[0] == "tool"]
    assert all(c["call_id"].startswith("call_") and c["id"].startswith("fc_") for c in calls)
    assert [c.get("namespace") for c in calls] == \
        ["multi_agent_v1" if p[1] == "spawn_agent" else None for p in parts if p[0] == "tool"]
    final = events[-1][1]["response"]
    assert final["usage"] == {"input_tokens": 1000, "output_tokens": 42, "total_tokens": 1042,
                              "input_tokens_details": {"cached_tokens": 0,
                                                       "cache_write_tokens": 0},
                              "output_tokens_details": {"reasoning_tokens": 7}}
    if status == "incomplete":
        assert final["incomplete_details"] == {"reason": "max_output_tokens"}

    if status != "completed":
        return  # the SDK helper only finishes on response.completed (Codex: an error too)
    with replay(200, data, "text/event-stream") as (url, http):
        client = openai.OpenAI(base_url=url + "/v1", api_key="test", http_client=http)
        with client.responses.stream(model="fake-model", input="create hello.txt") as s:
            got = s.get_final_response()
    assert [_view(i) for i in got.output] == _expected(parts)
    assert got.usage.input_tokens == 1000 and got.status == "completed"
    text = "".join(p[1] for p in parts if p[0] == "text")
    assert got.output_text == text


def test_reasoning_round_trip_through_encrypted_content():
    """Codex resends reasoning items with encrypted_content only: the exact text comes back."""
    reasoning = "  Odd spacing\n\nand unicode: héllo ✓\n"
    t = _new()
    data = b"".join(t.feed_chunk(c) for c in stream(
        [("reasoning", reasoning), ("tool", "exec_command", {"cmd": "ls"})],
        finish="tool_calls")) + t.finish()
    items = [o["item"] for n, o in parse_sse(data) if n == "response.output_item.done"]
    rs, call = items
    # What Codex sends back (it keeps summary + encrypted_content, not the raw content).
    resent = {"type": "reasoning", "id": rs["id"], "summary": [], "content": None,
              "encrypted_content": rs["encrypted_content"]}
    t2 = translator_for("POST", "/v1/responses")
    chat = t2.request_to_chat({**REQUEST, "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]},
        resent, call, {"type": "function_call_output", "call_id": call["call_id"],
                       "output": "a.txt"}]}, {})
    assistant = chat["messages"][1]
    assert assistant["reasoning_content"] == reasoning
    assert assistant["tool_calls"][0]["function"] == {"name": "exec_command",
                                                      "arguments": call["arguments"]}
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": call["call_id"],
                                   "content": "a.txt"}


def test_upstream_failure_mid_stream_is_response_failed():
    t = _new()
    chunks = stream([("text", "partial answer")])
    data = b"".join(t.feed_chunk(c) for c in chunks[:3]) + t.fail("upstream connection reset")
    events = parse_sse(data)
    name, obj = events[-1]
    assert name == "response.failed"
    EVENT.validate_python(obj)
    assert obj["response"]["status"] == "failed"
    assert obj["response"]["error"] == {"code": "server_error",
                                        "message": "upstream connection reset"}
    assert t.finish() == b"", "nothing follows a failure"
    t2 = _new()
    first = parse_sse(t2.fail("refused before the first chunk"))
    assert [n for n, _ in first] == ["response.created", "response.in_progress",
                                     "response.failed"]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_non_streaming_answer_validates(dialect):
    parts, finish, _ = CASES["tool"]
    t = _new()
    resp = t.response_from_chat(full_response(parts, dialect, finish=finish))
    r = Response.model_validate(resp)
    assert [_view(i) for i in r.output] == _expected(parts)
    assert r.usage.input_tokens == 1000 and r.status == "completed"
    with replay(200, json.dumps(resp).encode(), "application/json") as (url, http):
        client = openai.OpenAI(base_url=url + "/v1", api_key="test", http_client=http)
        got = client.responses.create(model="m", input="x")
    assert got.output_text == "I'll run it."


def test_upstream_error_answer_in_openai_shape():
    t = _new()
    status, body, ctype = t.error_from_chat(400, json.dumps({
        "object": "error", "message": "max_tokens is too large", "type": "BadRequestError",
        "code": 400}).encode())  # SGLang's error shape
    assert status == 400 and ctype == "application/json"
    with replay(status, body, ctype) as (url, http):
        client = openai.OpenAI(base_url=url + "/v1", api_key="test", http_client=http,
                               max_retries=0)
        with pytest.raises(openai.BadRequestError, match="max_tokens is too large"):
            client.responses.create(model="m", input="x")
