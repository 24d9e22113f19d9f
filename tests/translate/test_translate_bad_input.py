"""Bad input gets a clear TranslationError naming the problem, in the harness API's error shape;
odd upstream chunks are ignored or become the API's error event, never a crash."""
from __future__ import annotations

import json

import pytest

from polar_contracts.translate import TranslationError, translator_for
from tests.translate.chat_chunks import parse_sse, stream

USER = {"role": "user", "content": "hi"}


def _messages(body: dict):
    t = translator_for("POST", "/v1/messages")
    return t.request_to_chat({"model": "m", "max_tokens": 10, **body}, {})


def _responses(body: dict):
    t = translator_for("POST", "/v1/responses")
    return t.request_to_chat({"model": "m", **body}, {})


@pytest.mark.parametrize("body,match", [
    ({"messages": [USER, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_missing", "content": "x"}]}]},
     "toolu_missing"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
        {"type": "text", "text": "what is this?"}]}]}, "image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "document"),
    ({"messages": [{"role": "user", "content": [{"type": "frobnicate"}]}]}, "'frobnicate'"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}]},
     "'server_tool_use'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role 'tool'"),
    ({"messages": []}, "non-empty"),
    ({"messages": [USER], "thinking": {"type": "sometimes"}}, "thinking: unknown type"),
    ({"messages": [USER], "tool_choice": {"type": "maybe"}}, "tool_choice"),
    ({"messages": [USER], "system": [{"type": "image"}]}, "system"),
    ({"messages": [USER], "max_tokens": None}, "max_tokens is required"),
])
def test_messages_bad_input(body, match):
    with pytest.raises(TranslationError, match=match):
        _messages(body)


def test_messages_tool_result_in_image_content_is_refused():
    with pytest.raises(TranslationError, match="tool_result toolu_1: image"):
        _messages({"messages": [USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "image", "source": {}}]}]}]})


@pytest.mark.parametrize("body,match", [
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
     "call_nope"),
    ({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]}, "input_image"),
    ({"input": [{"type": "computer_call", "id": "c"}]}, "'computer_call'"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
    ({"input": [{"type": "message", "role": "critic", "content": "x"}]}, "'critic'"),
    ({"input": []}, "non-empty"),
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "tool_choice": 7}, "tool_choice"),
    ({"input": ["just a string"]}, r"input\[0\] must be an object"),
])
def test_responses_bad_input(body, match):
    with pytest.raises(TranslationError, match=match):
        _responses(body)


def test_non_object_body():
    for path in ("/v1/messages", "/v1/responses"):
        with pytest.raises(TranslationError, match="JSON object"):
            translator_for("POST", path).request_to_chat([1, 2], {})


def test_error_bodies_have_each_api_shape():
    body, ctype = translator_for("POST", "/v1/messages").error_body(400, "bad thing")
    assert ctype == "application/json"
    assert json.loads(body) == {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message": "bad thing"}}
    body, _ = translator_for("POST", "/v1/messages").error_body(503, "down")
    assert json.loads(body)["error"]["type"] == "api_error"
    body, ctype = translator_for("POST", "/v1/responses").error_body(400, "bad thing")
    assert json.loads(body) == {"error": {"message": "bad thing", "type": "invalid_request_error",
                                          "param": None, "code": None}}
    status, body, _ = translator_for("POST", "/v1/responses").error_from_chat(
        502, b"<html>Bad Gateway</html>")
    assert status == 502 and json.loads(body)["error"]["message"] == "<html>Bad Gateway</html>"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/responses"])
def test_unknown_chunk_fields_and_shapes_are_ignored(path):
    t = translator_for("POST", path)
    t.request_to_chat({"model": "m", "max_tokens": 5, "messages": [USER], "input": "hi"}
                      if path.endswith("messages") else {"model": "m", "input": "hi"}, {})
    chunks = stream([("text", "ok")])
    chunks[1]["kv_transfer_params"] = None
    chunks[1]["choices"][0]["delta"]["weird_future_field"] = {"x": 1}
    chunks.insert(2, {"object": "chat.completion.chunk", "choices": [
        {"index": 1, "delta": {"content": "other choice"}}]})  # never asked for: ignored
    chunks.insert(2, {"object": "chat.completion.chunk", "choices": []})
    data = b"".join(t.feed_chunk(c) for c in chunks) + t.finish()
    events = parse_sse(data)
    text = "".join(o["delta"].get("text", "") if "delta" in o and isinstance(o["delta"], dict)
                   else o.get("delta", "") if isinstance(o.get("delta"), str) else ""
                   for _, o in events)
    assert text == "ok"


@pytest.mark.parametrize("path,last", [("/v1/messages", "error"),
                                       ("/v1/responses", "response.failed")])
def test_error_object_inside_the_stream_becomes_the_api_error(path, last):
    t = translator_for("POST", path)
    t.request_to_chat({"model": "m", "max_tokens": 5, "messages": [USER]}
                      if path.endswith("messages") else {"model": "m", "input": "hi"}, {})
    chunks = stream([("text", "partial")])[:2]
    data = b"".join(t.feed_chunk(c) for c in chunks)
    data += t.feed_chunk({"error": {"message": "engine died", "type": "InternalServerError",
                                    "code": 500}})
    events = parse_sse(data)
    assert events[-1][0] == last and "engine died" in json.dumps(events[-1][1])
    assert t.finish() == b"" and t.feed_chunk(chunks[-1]) == b""


def test_tool_call_name_arriving_late_still_starts_the_block():
    t = translator_for("POST", "/v1/messages")
    t.request_to_chat({"model": "m", "max_tokens": 5, "messages": [USER]}, {})
    def ch(call):
        return {"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}
    data = t.feed_chunk(ch({"index": 0, "id": "x", "function": {"arguments": '{"a"'}}))
    data += t.feed_chunk(ch({"index": 0, "function": {"name": "Read", "arguments": ": 1}"}}))
    data += t.feed_chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    data += t.finish()
    events = parse_sse(data)
    start = [o for n, o in events if n == "content_block_start"][0]
    assert start["content_block"]["name"] == "Read"
    args = "".join(o["delta"]["partial_json"] for n, o in events if n == "content_block_delta")
    assert json.loads(args) == {"a": 1}


@pytest.mark.parametrize("path,last", [("/v1/messages", "error"),
                                       ("/v1/responses", "response.failed")])
def test_sglang_abort_finish_becomes_the_api_error(path, last):
    t = translator_for("POST", path)
    t.request_to_chat({"model": "m", "max_tokens": 5, "messages": [USER]}
                      if path.endswith("messages") else {"model": "m", "input": "hi"}, {})
    data = b"".join(t.feed_chunk(c) for c in stream([("text", "x")], "sglang", finish="abort"))
    data += t.finish()
    events = parse_sse(data)
    assert events[-1][0] == last and "aborted" in json.dumps(events[-1][1])
