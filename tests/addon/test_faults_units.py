"""The fault rules of docs/faults.md, sans-IO, without sockets (tests/faults has each class through mitmdump)."""
from __future__ import annotations

import os

import orjson
import pytest

from addon import call as calls
from addon.json_style import dumps_faithful, dumps_stripped
from addon.redact import credential_values
from addon.server_dialects import plan_request, sglext_header_flags, strip_response
from addon.sse import SSEParser
from addon.stream import serialize_event
from polar_contracts.control import ControlRequestError, parse_end_body
from polar_contracts.log.table import read_batches
from polar_contracts.log.writer import EpisodeWriter
from polar_contracts.request_fields import lax_bool


@pytest.mark.parametrize("v,want", [(True, True), ("true", True), (1, True), ("YES", True), (1.0, True),
                                    (False, False), ("false", False), (0, False), ("off", False),
                                    ("maybe", None), (2, None), (None, None), ([], None)])
def test_lax_bool_reads_like_pydantic(v, want):
    assert lax_bool(v) is want


def test_loose_stream_flags_plan_a_stream():
    for v in ("true", 1, "1"):
        assert plan_request("chat", "vllm", {"stream": v}).stream
        p = plan_request("chat", "sglang", {"stream": v})
        assert p.stream and "return_input_ids_in_sglext" in p.added
    assert not plan_request("chat", "vllm", {"stream": "false"}).stream
    assert "return_token_ids" in plan_request("chat", "vllm", {"return_token_ids": "false"}).added


@pytest.mark.parametrize("body", [b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": -Infinity}',
                                  b'{"reward": 1e400}', b'{"reward": ' + b"9" * 400 + b"}",
                                  b'{"metadata": {"x": NaN}}'])
def test_end_body_rejects_non_finite(body):
    with pytest.raises(ControlRequestError):
        parse_end_body(body)


def test_end_body_accepts_finite():
    assert parse_end_body(b'{"reward": 1e6, "metadata": {"big": 12345678901234567890123}}')[0] == 1e6
    # a finite reward beyond the bound is refused (1e308 overflows the trainer's group std) unless raised
    with pytest.raises(ControlRequestError, match="out of bounds"):
        parse_end_body(b'{"reward": 1e300}')
    assert parse_end_body(b'{"reward": 1e300}', max_abs_reward=1e308)[0] == 1e300


def _call(body: bytes, **kw) -> calls.CapturedCall:
    c = calls.CapturedCall("e", 0, "chat", "vllm", 0.0, b"")
    for k, v in kw.items():
        setattr(c, k, v)
    calls.prepare(c, body, {})
    return c


@pytest.mark.parametrize("ids", ["[null]", "[1.5]", "[2147483648]", "[true, null]"])
def test_malformed_ids_make_an_error_row_not_an_exception(ids):
    c = _call(b'{"model":"m","messages":[]}')
    out = calls.finish_body(c, 200, b'{"choices":[{"index":null,"message":{},"token_ids":' + ids.encode()
                            + b'}],"prompt_token_ids":[1,2]}')
    assert orjson.loads(out)["choices"][0]["token_ids"] is None
    (row,) = calls.rows(c, 1.0)
    assert "malformed answer" in row["error"] and row["completion_ids"] is None


def test_stream_bad_chunk_is_stripped_and_unparseable_event_is_an_error():
    c = _call(b'{"model":"m","stream":true,"messages":[]}')
    t = calls.start_response(c, 200, "text/event-stream")
    out = t(b'data: {"choices":[{"index":null,"delta":{"content":"a"},"token_ids":[null],'
            b'"logprobs":{"content":[{"logprob":-1}]}}],"prompt_token_ids":[1]}\n\ndata: {"cho\n\n')
    assert b"token_ids\":null" in out[0] and b"[1]" not in out[0] and out[0].endswith(b'data: {"cho\n\n')
    assert t(b"data: [DONE]\n\n") == [b"data: [DONE]\n\n"]
    calls.finish_stream(c)
    (row,) = calls.rows(c, 1.0)
    assert "could not be parsed" in row["error"] and "may miss tokens" in row["error"]


def test_final_event_failure_replaces_done_with_an_error_event():
    c = _call(b'{"model":"m","stream":true,"messages":[]}')
    t = calls.start_response(c, 200, "text/event-stream")
    t.on_final = lambda: "disk full"
    assert t(b"data: [DONE]\n\n") == [b'data: {"error":{"message":"disk full","type":"polar_proxy_error",'
                                      b'"code":503}}\n\n']


@pytest.mark.parametrize("fails", [False, True])
def test_stream_without_done_is_written_before_its_end(fails):
    """A server that ends its stream without [DONE]: the row is written at the end of the body,
    before the harness gets that end; if it cannot be, the harness gets an error event."""
    c = _call(b'{"model":"m","stream":true,"messages":[]}')
    t = calls.start_response(c, 200, "text/event-stream")
    written = []

    def final():
        calls.stream_final(c)
        written.append(calls.rows(c, 1.0))
        return "disk full" if fails else None
    t.on_final = final
    t(b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[7],"finish_reason":"stop",'
      b'"logprobs":{"content":[{"logprob":-1}]}}],"prompt_token_ids":[1]}\n\n')
    assert not written
    end = t(b"")
    assert len(written) == 1 and "stream ended without [DONE]" in written[0][0]["error"]
    assert end == ([b'data: {"error":{"message":"disk full","type":"polar_proxy_error","code":503}}\n\n']
                   if fails else [])
    c.written = True
    calls.finish_stream(c)  # (the response hook: nothing more goes into the row)
    assert written[0][0]["completion_ids"].tolist() == [7]


def test_huge_n_refused_and_big_ints_exact():
    with pytest.raises(calls.RequestRefused, match="polar_max_choices=128"):
        _call(b'{"model":"m","n":200000,"messages":[]}')
    with pytest.raises(calls.RequestRefused):
        _call(b'{"model":"m","n":"9","messages":[]}', max_choices=8)
    c = calls.CapturedCall("e", 0, "chat", "vllm", 0.0, b"")
    new = calls.prepare(c, b'{"model":"m","seed":123456789012345678901234567890,"logprobs":false}', {})
    assert b'"seed":123456789012345678901234567890' in new


def test_serialize_event_keeps_other_fields():
    raw = b"id: 7\r\nevent: x\r\n: note\r\ndata: {\"a\":1}\r\n\r\n"
    (ev,) = SSEParser().feed(raw)
    assert serialize_event(ev, b'{"a":2}') == raw.replace(b'{"a":1}', b'{"a":2}')
    (ev,) = SSEParser().feed(b'data: {"a":1}\n\n')
    assert serialize_event(ev, b"{}") == b"data: {}\n\n"


def test_dumps_faithful_keeps_number_text():
    raw = b'{"a":-1.19e-7,"b":1e-05,"c":123456789012345678901234567890,"d":[1,2],"e":"\xc3\xa9"}'
    assert dumps_faithful(raw, lambda o: o.pop("d")) == raw.replace(b',"d":[1,2]', b"")


@pytest.mark.parametrize("text", [rb"\ud83d", rb"\ude00", rb"\ud83d\ude00", rb"\uD83D", b"\\u00e9 \xc3\xa9",
                                  rb"\/", rb"\\ud83d", rb"\u001F \" \n \\"])
@pytest.mark.parametrize("spaced", [False, True])
def test_dumps_stripped_writes_every_escape_back_as_it_was(text, spaced):
    raw = (b'{"choices":[{"index":0,"delta":{"content":"<' + text + b'>"},"logprobs":{"content":[{"token":"'
           + text + b'","logprob":-1.19e-7}]},"token_ids":[5]}],"usage":{"x":12345678901234567890123}}')
    if spaced:  # (a Python json.dumps server: its floats are Python's repr)
        raw = raw.replace(b'":', b'": ').replace(b',"', b', "').replace(b"-1.19e-7", b"-1.19e-07")
    want = raw.replace(b"[5]", b"null")
    assert dumps_stripped(raw, lambda o: o["choices"][0].update(token_ids=None)) == want


def test_sglext_ids_asked_by_header_are_the_harness_own():
    h = {"x-sglext-return-output-ids": "1", "x-sglext-return-input-ids": "true"}  # (SGLang: exactly "1")
    flags = sglext_header_flags("sglang", h)
    assert flags == {"return_output_ids_in_sglext"} and sglext_header_flags("vllm", h) == frozenset()
    plan = plan_request("chat", "sglang", {"stream": True}, flags)
    assert "return_output_ids_in_sglext" not in plan.added and "return_input_ids_in_sglext" in plan.added
    obj = {"choices": [], "usage": None, "sglext": {"input_ids": [1], "output_ids": [[2]]}}
    assert strip_response(plan, obj) is True and obj["sglext"] == {"output_ids": [[2]]}
    obj = {"choices": [], "usage": None, "sglext": {"input_ids": [1], "output_ids": [[2]]}}
    assert strip_response(plan_request("chat", "sglang", {"stream": True}), obj) is None  # not asked: dropped


def test_credentials_from_headers_and_query():
    got = credential_values([(b"Authorization", b"Bearer sk-abc"), (b"x-other", b"v")],
                            "/v1/chat/completions?api_key=sk-q%2B1&x=2")
    assert {"Bearer sk-abc", "sk-abc", "sk-q+1"} <= set(got)
    assert calls.SECRET_KEY_RE.search(b'{"api\\u005fkey": "x"}')
    text = calls.log_request_text(b'{"api\\u005fkey": "sk-xyz", "m": 1}', calls.UNPARSED)
    assert b"sk-xyz" not in text


def test_writer_suspends_reopens_and_marks_a_deleted_file(tmp_path):
    p = tmp_path / "e.arrow"
    w = EpisodeWriter(p, "e")
    row = dict(prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.5])
    w.append_call(call_index=0, **row)
    w.suspend()
    assert not w.is_open
    w.append_call(call_index=1, **row)  # reopened on demand
    assert w.is_open
    os.unlink(p)
    w.append_call(call_index=2, **row)
    w.note_lost(3, "call 3 could not be recorded (disk full)")
    w.end(1.0, {})
    t = [b.to_pylist() for b in read_batches(p)[0]]
    kinds = [r[0]["kind"] for r in t]
    assert kinds == ["incomplete", "call", "incomplete", "end"]
    assert '"discard": true' in t[-1][0]["metadata"] and "deleted" in t[0][0]["error"]


@pytest.mark.parametrize("path,failed,completed", [("/v1/responses", b"response.failed", b"response.completed"),
                                                   ("/v1/messages", b"event: error", b"message_stop")])
def test_translated_stream_not_recorded_ends_in_the_apis_failure(path, failed, completed):
    from polar_contracts.translate import translator_for

    t0 = translator_for("POST", path)
    c = calls.CapturedCall("e", 0, t0.api, "vllm", 0.0, b"")
    c.translator = t0
    body = (b'{"model":"m","input":"hi","stream":true}' if "responses" in path else
            b'{"model":"m","max_tokens":5,"messages":[{"role":"user","content":"hi"}],"stream":true}')
    calls.prepare(c, body, {})
    t = calls.start_response(c, 200, "text/event-stream")
    t.on_final = lambda: "disk full"
    t(b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"stop","token_ids":[1]}],'
      b'"prompt_token_ids":[1]}\n\n')
    out = b"".join(t(b"data: [DONE]\n\n"))
    assert failed in out and b"disk full" in out and completed not in out


def test_whole_answer_with_a_lone_surrogate_is_read_and_stripped():
    c = _call(b'{"model":"m","messages":[]}')
    body = (b'{"choices":[{"index":0,"message":{"content":"a\\ud800 \xc3\xa9"},"token_ids":[5],'
            b'"logprobs":{"content":[{"logprob":-1}]}}],"prompt_token_ids":[1,2]}')
    out = calls.finish_body(c, 200, body)
    obj = orjson.loads(out.replace(b"\\ud800", b""))
    assert obj["choices"][0]["token_ids"] is None and b"\\ud800" in out
    (row,) = calls.rows(c, 1.0)
    assert row["error"] is None and list(row["completion_ids"]) == [5]


def test_writer_restart_refused_by_a_full_disk_recovers_later(tmp_path, monkeypatch):
    p = tmp_path / "e.arrow"
    w = EpisodeWriter(p, "e")
    row = dict(prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.5])
    w.append_call(call_index=0, **row)
    os.unlink(p)
    real = EpisodeWriter._append

    def full(self, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EpisodeWriter, "_append", full)
    with pytest.raises(OSError):
        w.append_call(call_index=1, **row)  # the new file is created, its first bytes refused
    assert p.exists() and p.stat().st_size == 0 and not w.is_open
    monkeypatch.setattr(EpisodeWriter, "_append", real)
    w.append_call(call_index=2, **row)
    kinds = [b.to_pylist()[0]["kind"] for b in read_batches(p)[0]]
    assert kinds == ["incomplete", "call"]
    other = tmp_path / "o.arrow"  # a writer never appends to another file found at its path
    w2 = EpisodeWriter(other, "o")
    w2.append_call(call_index=0, **row)
    os.unlink(other)
    other.write_bytes(b"someone else's")
    w2.suspend()
    with pytest.raises(Exception, match="replaced or changed"):
        w2.append_call(call_index=1, **row)
    assert other.read_bytes() == b"someone else's"


def test_bounded_decode_stops_one_byte_past_the_bound():
    import gzip
    import zlib

    import zstandard

    from addon.bounded_decode import BodyTooLarge, EncodingRefused, bounded_decode
    body = b'{"a":"' + b"x" * 1000 + b'"}'
    for enc, data in (("gzip", gzip.compress(body)), ("x-gzip", gzip.compress(body)),
                      ("deflate", zlib.compress(body)), ("deflate", zlib.compress(body)[2:-4]),  # raw deflate
                      ("zstd", zstandard.ZstdCompressor().compress(body)), ("identity, gzip", gzip.compress(body)),
                      ("gzip, gzip", gzip.compress(gzip.compress(body)))):
        assert bounded_decode(data, enc, len(body)) == body, enc
        with pytest.raises(BodyTooLarge):
            bounded_decode(data, enc, len(body) - 1)
    bomb = gzip.compress(b"\0" * (64 * 2**20))
    with pytest.raises(BodyTooLarge):
        bounded_decode(bomb, "gzip", 2**20)
    with pytest.raises(EncodingRefused, match="'compress'"):
        bounded_decode(b"x", "compress", 10)
    with pytest.raises(ValueError, match="gzip"):
        bounded_decode(b"not gzip", "gzip", 10)
    import brotli
    try:
        assert bounded_decode(brotli.compress(body), "br", len(body)) == body  # (brotli >= 1.2: bounded)
    except EncodingRefused as exc:  # (older brotli: no output bound, so refused, never inflated)
        assert "br cannot be decompressed with a size bound" in str(exc)
