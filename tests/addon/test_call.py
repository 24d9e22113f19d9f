import json

import orjson

from addon.call import add_fields, log_request_text
from addon.redact import redact_headers


def test_splice_keeps_harness_bytes():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "h\xc3\xa9"}]}  \n'
    body = json.loads(raw)
    new = add_fields(raw, body, {"return_token_ids": True, "logprobs": True})
    assert new.startswith(raw[:-4])
    assert json.loads(new) == {**body, "return_token_ids": True, "logprobs": True}


def test_conflicting_key_reserializes_without_duplicates():
    raw = b'{"logprobs": false, "x": 1}'
    new = add_fields(raw, json.loads(raw), {"logprobs": True})
    assert new.count(b"logprobs") == 1 and json.loads(new) == {"logprobs": True, "x": 1}


def test_empty_object():
    assert json.loads(add_fields(b"{}", {}, {"a": 1})) == {"a": 1}


def test_secrets_redacted_in_log_text():
    raw = b'{"model": "m", "api_key": "sk-123", "extra": {"Authorization": "Bearer x"}}'
    text = log_request_text(raw, orjson.loads(raw)).decode()
    assert "sk-123" not in text and "Bearer x" not in text and json.loads(text)["model"] == "m"
    plain = b'{"model": "m"}'
    assert log_request_text(plain, orjson.loads(plain)) == plain
    assert redact_headers({"Authorization": "Bearer k", "x-api-key": "k", "a": "b"}) == {
        "Authorization": "[redacted]", "x-api-key": "[redacted]", "a": "b"}


def test_translator_notes_from_finish_reach_the_row():
    """A note the translator adds only at finish() (after the request was prepared) is on the row."""
    from addon import call as calls
    from addon.translate import translator_for

    c = calls.Call("e", 0, "responses", "vllm", 0.0, b"")
    c.translator = translator_for("POST", "/v1/responses")
    raw = json.dumps({"model": "m", "input": "hi", "stream": True}).encode()
    assert calls.prepare(c, raw, {}) is not None
    f = calls.start_response(c, 200, "text/event-stream")
    head = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [
        {**head, "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                         "logprobs": None, "finish_reason": None, "token_ids": []}]},
        {**head, "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]},
                              "logprobs": {"content": [{"token": "x", "logprob": -0.1}]}, "finish_reason": "tool_calls",
                              "token_ids": [7]}]},
    ]
    body = b"".join(b"data: " + json.dumps(ch).encode() + b"\n\n" for ch in chunks) + b"data: [DONE]\n\n"
    out = f(body) + f(b"")
    assert b"response.completed" in b"".join(out)
    calls.finish_stream(c)
    (row,) = calls.rows(c, 1.0)
    assert any("never named its function" in n for n in row["notes"]), row["notes"]
    assert row["completion_ids"].tolist() == [7] and row["error"] is None
