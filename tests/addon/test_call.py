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
