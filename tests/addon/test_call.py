import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from addon import call as calls
from addon import jsonhead
from addon.call import add_fields, log_request_text
from addon.redact import redact_headers
from addon.server_dialects import REQUEST_KEYS, plan_request


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
    from polar_contracts.translate import translator_for

    c = calls.CapturedCall("e", 0, "responses", "vllm", 0.0, b"")
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


# -- the request's top-level fields read without building the body (addon/jsonhead.py) ----------


_KEYS = [*REQUEST_KEYS, "model", "top_logprobs", "messages", "tools"]
_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 5) | st.text(max_size=4)
                       | st.integers(2**64, 2**70),  # big ints: simdjson refuses, orjson reads a float
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=3),
                       max_leaves=8)
_bodies = st.dictionaries(st.sampled_from(_KEYS), _values, max_size=6)


def test_simdjson_is_installed_for_the_fast_path():
    assert jsonhead._simdjson is not None, "pysimdjson is a dependency (setup.cfg): the request path needs it"


def test_plan_request_reads_only_request_keys():
    seen = set()

    class Spy(dict):
        def get(self, k, default=None):
            seen.add(k)
            return super().get(k, default)

        def __contains__(self, k):
            seen.add(k)
            return super().__contains__(k)

        def __getitem__(self, k):
            seen.add(k)
            return super().__getitem__(k)

    for api in ("chat", "completions"):
        for dialect in ("vllm", "sglang"):
            for stream in (True, False):
                plan_request(api, dialect, Spy(stream=stream))
    assert seen <= set(REQUEST_KEYS), seen - set(REQUEST_KEYS)


def _prepared(raw, api, dialect, fast, monkeypatch):
    monkeypatch.setattr(jsonhead, "_simdjson", jsonhead._simdjson if fast else None)
    c = calls.CapturedCall("e", 0, api, dialect, 0.0, b"")
    try:
        out = calls.prepare(c, raw, {})
    except calls.RequestRefused as exc:  # (n past polar_max_choices: the same refusal either way)
        out = f"refused: {exc}"
    calls.finish_request_text(c)
    return out, c


@settings(max_examples=300, deadline=None)
@given(_bodies, st.sampled_from(["chat", "completions"]), st.sampled_from(["vllm", "sglang"]),
       st.sampled_from([(",", ":"), (", ", ": ")]), st.booleans())
def test_top_level_read_rewrites_exactly_as_the_full_parse(body, api, dialect, seps, dup):
    """Same bytes upstream, same plan, model, log text and errors with and without simdjson."""
    raw = json.dumps(body, separators=seps).encode()
    if dup and body:  # a repeated key: servers read the last one
        k = next(iter(body))
        raw = raw[:-1] + (b"," if len(body) else b"") + json.dumps({k: True})[1:-1].encode() + b"}"
    with pytest.MonkeyPatch.context() as mp:
        fast_out, fast = _prepared(raw, api, dialect, True, mp)
        slow_out, slow = _prepared(raw, api, dialect, False, mp)
    assert fast_out == slow_out
    assert fast.plan == slow.plan and fast.model == slow.model and fast.stream == slow.stream
    assert fast.request_text == slow.request_text and fast.errors == slow.errors


def test_secret_in_a_request_read_through_the_fast_path_is_redacted():
    raw = json.dumps({"model": "m", "messages": [], "api_key": "sk-123"}).encode()
    c = calls.CapturedCall("e", 0, "chat", "vllm", 0.0, b"")
    calls.prepare(c, raw, {})
    calls.finish_request_text(c)
    assert b"sk-123" not in c.request_text and b"[redacted]" in c.request_text


def test_secret_echoed_by_the_server_is_scrubbed_from_the_row():
    """vLLM's validation errors quote the request ("input": {...}): the key the request text
    hides must not reach the row through the error or the response either."""
    secret = "sk-live-0123456789abcdef"
    for raw in (json.dumps({"model": "m", "messages": "oops", "api_key": secret}).encode(),  # valid JSON
                b'{"model": "m", "api_key": "' + secret.encode() + b'", "messages": [}'):  # not JSON
        c = calls.CapturedCall("e", 0, "chat", "vllm", 0.0, b"")
        calls.prepare(c, raw, {})
        echo = json.dumps({"object": "error", "message": f"[{{'type': 'list_type', 'input': {raw.decode()!r}}}]"})
        calls.finish_body(c, 400, echo.encode())
        (row,) = calls.rows(c, 1.0)
        text = json.dumps(row, default=str)
        assert secret not in text, text
        assert "[redacted]" in row["error"] and "[redacted]" in row["response"].decode()
