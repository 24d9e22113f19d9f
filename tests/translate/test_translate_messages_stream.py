"""Chat answers (vLLM and SGLang shapes) translated to the Anthropic Messages API: every event
parses as the SDK's RawMessageStreamEvent, the SDK's own streaming helper accumulates the
message, and the non-streaming answer validates as anthropic.types.Message."""
from __future__ import annotations

import json

import anthropic
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from polar_contracts.translate import translator_for
from tests.translate.chat_chunks import full_response, parse_sse, stream
from tests.translate.replay_server import replay

EVENT = TypeAdapter(RawMessageStreamEvent)
REQUEST = {"model": "claude-opus-4-8", "max_tokens": 64, "stream": True,
           "stop_sequences": ["###"],
           "thinking": {"type": "adaptive"}, "messages": [{"role": "user", "content": "hi"}]}

CASES = {
    "text": ([("text", "Hello there, how can I help?")], "stop", "end_turn"),
    "reasoning_text": ([("reasoning", "The user greets me."), ("text", "Hi!")], "stop",
                       "end_turn"),
    "tool": ([("reasoning", "Use the shell."), ("text", "I'll run it.\n\n"),
              ("tool", "Bash", {"command": "echo hi > hello.txt", "description": "write"})],
             "tool_calls", "tool_use"),
    "two_tools": ([("tool", "Read", {"file_path": "/a"}), ("tool", "Read", {"file_path": "/b"})],
                  "tool_calls", "tool_use"),
    "length": ([("reasoning", "Thinking for a long time and")], "length", "max_tokens"),
}


def _translate_stream(chunks: list[dict]) -> tuple[bytes, list[bytes]]:
    t = translator_for("POST", "/v1/messages?beta=true")
    t.request_to_chat(REQUEST, {})
    pieces = [t.feed_chunk(c) for c in chunks]
    pieces.append(t.finish())
    return b"".join(pieces), pieces


def _expected_blocks(parts):
    out = []
    for p in parts:
        if p[0] == "reasoning":
            out.append(("thinking", p[1]))
        elif p[0] == "text":
            out.append(("text", p[1]))
        else:
            out.append(("tool_use", (p[1], p[2])))
    return out


def _block_view(block):
    if block.type == "thinking":
        return ("thinking", block.thinking)
    if block.type == "text":
        return ("text", block.text)
    return ("tool_use", (block.name, block.input))


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_events_parse_and_accumulate(case, dialect):
    parts, finish, stop_reason = CASES[case]
    chunks = stream(parts, dialect, finish=finish, completion_tokens=42)
    data, pieces = _translate_stream(chunks)
    assert pieces[0].startswith(b"event: message_start\n"), "first chunk opens the message"
    events = parse_sse(data)
    for name, obj in events:
        assert name == obj["type"]
        EVENT.validate_python(obj)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    # Every block is started and stopped, in order, and never left open.
    starts = [o["index"] for n, o in events if n == "content_block_start"]
    stops = [o["index"] for n, o in events if n == "content_block_stop"]
    assert starts == stops == list(range(len(parts)))
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == stop_reason
    assert delta["usage"]["output_tokens"] == 42 and delta["usage"]["input_tokens"] == 1000
    if dialect == "vllm":  # vLLM's first chunk carries the prompt ids: the count is known early
        assert events[0][1]["message"]["usage"]["input_tokens"] == 1000

    with replay(200, data, "text/event-stream") as (url, http):
        client = anthropic.Anthropic(base_url=url, api_key="test", http_client=http)
        with client.messages.stream(model=REQUEST["model"], max_tokens=64,
                                    messages=REQUEST["messages"]) as s:
            final = s.get_final_message()
    assert [_block_view(b) for b in final.content] == _expected_blocks(parts)
    assert final.stop_reason == stop_reason
    assert final.usage.input_tokens == 1000 and final.usage.output_tokens == 42
    assert final.model == "claude-opus-4-8"
    for block in final.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_")
        if block.type == "thinking":
            assert block.signature


def test_stop_sequence_reported():
    for dialect in ("vllm", "sglang"):
        data, _ = _translate_stream(stream([("text", "done")], dialect, finish="stop", stop="###"))
        delta = [o for n, o in parse_sse(data) if n == "message_delta"][0]
        assert delta["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}


def test_upstream_failure_mid_stream_is_an_error_event():
    t = translator_for("POST", "/v1/messages")
    t.request_to_chat(REQUEST, {})
    chunks = stream([("text", "partial answer")])
    data = b"".join(t.feed_chunk(c) for c in chunks[:3]) + t.fail("upstream connection reset")
    events = parse_sse(data)
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "upstream connection reset"}})
    # The error event is not a RawMessageStreamEvent: the SDK raises it as an API error.
    with replay(200, data, "text/event-stream") as (url, http):
        client = anthropic.Anthropic(base_url=url, api_key="test", http_client=http,
                                     max_retries=0)
        with pytest.raises(anthropic.APIStatusError, match="upstream connection reset"):
            with client.messages.stream(model="m", max_tokens=5, messages=REQUEST["messages"]) as s:
                s.get_final_message()


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_non_streaming_answer_validates(dialect):
    parts, finish, stop_reason = CASES["tool"]
    t = translator_for("POST", "/v1/messages")
    t.request_to_chat({**REQUEST, "stream": False}, {})
    msg = t.response_from_chat(full_response(parts, dialect, finish=finish))
    m = Message.model_validate(msg)
    assert [_block_view(b) for b in m.content] == _expected_blocks(parts)
    assert m.stop_reason == stop_reason and m.usage.input_tokens == 1000
    with replay(200, json.dumps(msg).encode(), "application/json") as (url, http):
        client = anthropic.Anthropic(base_url=url, api_key="test", http_client=http)
        got = client.messages.create(model="m", max_tokens=5, messages=REQUEST["messages"])
    assert got.content[-1].input == parts[-1][2]


def test_upstream_error_answer_in_anthropic_shape():
    t = translator_for("POST", "/v1/messages")
    status, body, ctype = t.error_from_chat(404, json.dumps({"error": {
        "message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}).encode())
    assert status == 404 and ctype == "application/json"
    assert json.loads(body) == {"type": "error", "error": {
        "type": "not_found_error", "message": "The model `x` does not exist."}}
    with replay(status, body, ctype) as (url, http):
        client = anthropic.Anthropic(base_url=url, api_key="test", http_client=http,
                                     max_retries=0)
        with pytest.raises(anthropic.NotFoundError, match="does not exist"):
            client.messages.create(model="m", max_tokens=5, messages=REQUEST["messages"])


def test_answer_resent_by_the_harness_returns_to_the_history():
    """What Claude Code sends back (the SDK's final message as the assistant turn, then the tool
    result) reaches the chat history with the exact reasoning and the call's arguments."""
    reasoning = "  Odd spacing\n\nand unicode: héllo ✓\n"
    parts = [("reasoning", reasoning), ("text", "Running it."),
             ("tool", "Bash", {"command": "ls", "description": "list"})]
    data, _ = _translate_stream(stream(parts, "sglang", finish="tool_calls"))
    with replay(200, data, "text/event-stream") as (url, http):
        client = anthropic.Anthropic(base_url=url, api_key="test", http_client=http)
        with client.messages.stream(model="m", max_tokens=64, messages=REQUEST["messages"]) as s:
            final = s.get_final_message()
    tool_use = final.content[-1]
    t = translator_for("POST", "/v1/messages?beta=true")
    chat = t.request_to_chat({**REQUEST, "messages": REQUEST["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                      "content": "hello.txt"}]}]}, {})
    assistant, tool = chat["messages"][1:]
    assert assistant["reasoning_content"] == reasoning
    assert assistant["content"] == "Running it."
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == parts[2][2]
    assert tool == {"role": "tool", "tool_call_id": tool_use.id, "content": "hello.txt"}


def test_tool_calls_with_a_plain_stop_finish_still_say_tool_use():
    data, _ = _translate_stream(stream([("tool", "Bash", {"command": "ls"})], finish="stop"))
    delta = [o for n, o in parse_sse(data) if n == "message_delta"][0]
    assert delta["delta"]["stop_reason"] == "tool_use"
