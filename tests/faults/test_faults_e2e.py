"""Each class of fault through a real mitmdump with the addon (docs/faults.md has the
table). The upstream is tests/faults/scripted_upstream.py, answering what each request scripts."""
from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pytest

from polar_contracts.log.arrays import read_head
from polar_contracts.log.reader import read_log
from polar_contracts.log.table import read_batches

from .conftest import proxy, scripted
from .helpers import CHAT, PROMPT, call, chunk, end, ep, good_stream, sse, whole

NO_SKIP = os.environ.get("POLAR_NO_SKIP") == "1"


def rows_of(path: Path) -> list[dict]:
    batches = read_batches(path)[0]
    if not batches:
        return []
    return pa.Table.from_batches(batches).select(["kind", "call_index", "error", "metadata"]).to_pylist()


def log_of(logdir: Path, e: str) -> Path:
    return logdir / f"{e}.arrow"


def stream_spec(chunks=None, **kw) -> dict:
    return {"status": 200, "ctype": "text/event-stream", "chunks": chunks or good_stream(), **kw}


def ok_spec(ids=(9707,), **kw) -> dict:
    return {"status": 200, "body": whole(list(ids)), **kw}


# ---- 1. storage faults ----------------------------------------------------------------------------

def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        msg = f"cannot mount a tmpfs for the disk-full test: {r.stderr.decode().strip() or r.returncode}"
        if NO_SKIP:
            pytest.fail(msg + " (POLAR_NO_SKIP=1: this test must run; run it as root)")
        print(msg)
        pytest.skip(msg)


def _fill(path: Path) -> Path:
    filler = path / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        for size in (65536, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_disk_full_refuses_unrecorded_calls_and_recovers(tmp_path):
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "4m")
    try:
        logdir = disk / "logs"
        with scripted(tmp_path) as up, proxy(tmp_path, logdir, up.url) as px:
            e = ep()
            assert call(px, e, ok_spec())[0] == 200
            filler = _fill(disk)
            # whole answers: 503 naming the cause, never a 200 whose row is not on disk (the
            # file's last tmpfs page may still take a row or two)
            statuses = []
            for _ in range(12):
                st, body, _ = call(px, e, ok_spec())
                statuses.append(st)
                assert st == 200 or (st == 503 and b"No space left on device" in body
                                     and b"could not record" in body), body
            assert statuses[-5:] == [503] * 5, statuses
            ok = statuses.count(200)
            # a stream: the harness gets an error event instead of [DONE]
            st, body, _ = call(px, e, stream_spec(), stream=True)
            assert st == 200 and b"[DONE]" not in body and b"No space left on device" in body, body
            # new episodes whose log cannot be started: 503, and no descriptor leaked per try
            before = _fds(px.pid)
            for _ in range(30):
                st, body, _ = call(px, ep(), ok_spec())
                assert st == 503 and b"No space left" in body
            assert _fds(px.pid) <= before + 2
            # the disk recovers: so does the proxy, by itself
            filler.unlink()
            st, body, _ = call(px, e, ok_spec())
            assert st == 200, body
            assert end(px, e, {"reward": 1.0})[0] == 200
        rows = rows_of(log_of(logdir, e))
        kinds = [r["kind"] for r in rows]
        lost = statuses.count(503) + 1  # (+ the stream)
        assert kinds.count("call") == 2 + ok and kinds.count("incomplete") == lost and kinds[-1] == "end"
        assert all("No space left" in r["error"] for r in rows if r["kind"] == "incomplete")
        head = read_head(log_of(logdir, e))
        assert head.metadata["discard"] is True and len(head.metadata["polar_incomplete"]) == lost
        assert len(read_log(log_of(logdir, e))) == 2 + ok  # the readers of calls still read it
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _two_choices() -> str:
    obj = json.loads(whole([9707]))
    obj["choices"].append({**obj["choices"][0], "index": 1, "token_ids": [1052]})
    return json.dumps(obj, separators=(",", ":"))


# (shape, spec, stream): each call's answer as the harness reads it: "ok" (a success), "refused"
# (told that it was not recorded), anything else fails the test
DISK_SHAPES = [
    ("whole", ok_spec(), None),
    ("stream", stream_spec(), True),
    ("stream-without-done", stream_spec(good_stream()[:-1]), True),
    ("two-choices", {"status": 200, "body": _two_choices()}, None),
]


def _verdict(shape: str, st: int, body: bytes) -> str:
    if st == 503 and b"could not record" in body and b"No space left on device" in body:
        return "refused"
    assert st == 200, (shape, st, body[:300])
    if shape.startswith("stream"):
        if b"polar_proxy_error" in body:
            assert b"No space left on device" in body and b"[DONE]" not in body, body
            return "refused"
        assert body.endswith(b"data: [DONE]\n\n") == (shape == "stream"), body
    return "ok"


def test_disk_filled_by_the_logs_every_success_has_its_row(tmp_path):
    """The logs themselves fill the disk (big requests, four calls at a time, whole answers,
    streams with and without [DONE], two-choice calls): every call the harness saw succeed has its
    rows, every call refused is marked incomplete, and calls are recorded again once space frees."""
    from concurrent.futures import ThreadPoolExecutor

    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "3m")
    try:
        logdir = disk / "logs"
        filler = disk / "filler"
        filler.write_bytes(os.urandom(1_500_000))  # (freed later: the recovery)
        with scripted(tmp_path) as up, proxy(tmp_path, logdir, up.url) as px:
            eps = [ep() for _ in range(3)]
            for e in eps:  # (each episode's log exists before the disk fills)
                assert call(px, e, ok_spec())[0] == 200

            def one(i: int, phase: str) -> tuple[str, str, str, str]:
                shape, spec, stream = DISK_SHAPES[i % len(DISK_SHAPES)]
                marker = f"{phase}-{i}-{os.urandom(4).hex()}"
                text = marker + " " + os.urandom(12_000).hex()  # (~24 KB, incompressible: ~12 KB a row)
                body = {**CHAT, "messages": [{"role": "user", "content": text}],
                        **({"n": 2} if shape == "two-choices" else {})}
                st, raw, _ = call(px, eps[i % 3], spec, body, stream=stream)
                return eps[i % 3], marker, shape, _verdict(shape, st, raw)

            with ThreadPoolExecutor(4) as pool:
                fill = list(pool.map(lambda i: one(i, "fill"), range(200)))
            assert [v for *_, v in fill[-12:]] == ["refused"] * 12, [v for *_, v in fill]
            filler.unlink()
            after = [one(i, "after") for i in range(8)]
            assert all(v == "ok" for *_, v in after), after
            for e in eps:
                assert end(px, e, {"reward": 1.0})[0] == 200
        answers = fill + after
        for e in eps:
            df = read_log(log_of(logdir, e))
            rows = rows_of(log_of(logdir, e))
            mine = [a for a in answers if a[0] == e]
            ok = [m for _, m, _, v in mine if v == "ok"]
            requests = df["request"].to_list()
            for m in ok:  # every success has its rows, with their ids
                hit = [j for j, r in enumerate(requests) if m in r]
                shape = next(s for _, mm, s, _ in mine if mm == m)
                assert len(hit) == (2 if shape == "two-choices" else 1), (m, shape)
                assert all(df["completion_ids"][j] is not None and len(df["completion_ids"][j]) for j in hit)
            refused = sum(v == "refused" for *_, v in mine)
            assert refused > 0 and [r["kind"] for r in rows].count("incomplete") == refused
            # (a two-choice call refused after its first row got to disk leaves that row: marked)
            assert len(df) - 1 <= len(ok) + sum(s == "two-choices" for _, _, s, v in mine if v == "ok") + refused
            assert read_head(log_of(logdir, e)).metadata["discard"] is True
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_deleted_log_file_and_directory(stack):
    up, px, logdir = stack
    e = ep()
    assert call(px, e, ok_spec())[0] == 200
    log_of(logdir, e).unlink()
    st, _, _ = call(px, e, ok_spec())
    assert st == 200  # (its row is on disk: in a new file that says the earlier rows are lost)
    rows = rows_of(log_of(logdir, e))
    assert [r["kind"] for r in rows] == ["incomplete", "call"] and "deleted" in rows[0]["error"]
    e2 = ep()
    assert call(px, e2, ok_spec())[0] == 200
    shutil.rmtree(logdir)
    assert call(px, e2, ok_spec())[0] == 200
    assert [r["kind"] for r in rows_of(log_of(logdir, e2))] == ["incomplete", "call"]
    assert end(px, e2)[0] == 200
    assert read_head(log_of(logdir, e2)).metadata["discard"] is True


def test_log_that_cannot_be_opened_is_refused_not_forwarded(stack):
    up, px, logdir = stack
    e = ep()
    logdir.mkdir(exist_ok=True)
    log_of(logdir, e).mkdir()  # (as root, permissions do not stop writes: a directory in the way does)
    n = up.record.read_text().count("\n") if up.record.exists() else 0
    st, body, _ = call(px, e, ok_spec())
    assert st == 503 and b"could not record" in body, body
    assert (up.record.read_text().count("\n") if up.record.exists() else 0) == n  # never forwarded
    log_of(logdir, e).rmdir()
    assert call(px, e, ok_spec())[0] == 200


def test_descriptors_bounded_under_ulimit(tmp_path):
    logdir = tmp_path / "logs"
    with scripted(tmp_path) as up, proxy(tmp_path, logdir, up.url, polar_max_open_logs=32) as px:
        resource.prlimit(px.pid, resource.RLIMIT_NOFILE, (160, 160))
        spec = ok_spec()
        eps = [ep() for _ in range(300)]
        with httpx.Client(timeout=30) as c:
            from .scripted_upstream import answer_header
            h = {"content-type": "application/json", "x-answer": answer_header(spec)}
            for e in eps:  # episodes never ended: one call each, and again later
                r = c.post(px.url + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                           headers={**h, "x-polar-episode": e})
                assert r.status_code == 200, r.text
            assert _fds(px.pid) < 100
            for e in eps[:40]:  # reopened on demand
                r = c.post(px.url + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                           headers={**h, "x-polar-episode": e})
                assert r.status_code == 200, r.text
    for i, e in enumerate(eps):
        df = read_log(log_of(logdir, e))
        assert len(df) == (2 if i < 40 else 1) and df["error"].null_count() == len(df)


def test_descriptors_exhausted_means_503_never_unrecorded(tmp_path):
    """With the bound set above the process's own limit, opens fail (EMFILE): refused, not
    forwarded unrecorded; every 200 has its row."""
    logdir = tmp_path / "logs"
    with scripted(tmp_path) as up, proxy(tmp_path, logdir, up.url, polar_max_open_logs=100000) as px:
        resource.prlimit(px.pid, resource.RLIMIT_NOFILE, (_fds(px.pid) + 40, _fds(px.pid) + 40))
        from .scripted_upstream import answer_header
        h = {"content-type": "application/json", "x-answer": answer_header(ok_spec())}
        statuses = {}
        with httpx.Client(timeout=30) as c:
            for _ in range(120):
                e = ep()
                r = c.post(px.url + "/v1/chat/completions", content=json.dumps(CHAT).encode(),
                           headers={**h, "x-polar-episode": e})
                statuses[e] = r.status_code
                assert r.status_code == 200 or (r.status_code == 503 and "could not record" in r.text), r.text
    assert 503 in statuses.values() and 200 in statuses.values()
    for e, st in statuses.items():
        if st == 200:
            assert len(read_log(log_of(logdir, e))) == 1


# ---- 2. malformed 200 answers --------------------------------------------------------------------

@pytest.mark.parametrize("ids", [[None], [1.5], [2**31], [2**40]])
def test_malformed_ids_whole_answer(stack, ids):
    up, px, logdir = stack
    e = ep()
    st, body, _ = call(px, e, {"status": 200, "body": whole(ids)})
    assert st == 200
    obj = json.loads(body)
    assert obj["choices"][0]["token_ids"] is None and obj["prompt_token_ids"] is None  # stripped all the same
    assert end(px, e)[0] == 200  # the call finished: the end record is written at once
    df = read_log(log_of(logdir, e))
    assert "malformed answer: completion token ids not all int32" in df["error"][0]
    assert read_head(log_of(logdir, e)).finished


def test_null_choice_index_and_bad_prompt(stack):
    up, px, logdir = stack
    e = ep()
    st, body, _ = call(px, e, {"status": 200, "body": whole([5], prompt=[1, None], index=None)})
    assert st == 200 and json.loads(body)["prompt_token_ids"] is None
    assert end(px, e)[0] == 200
    assert "prompt token ids not all int32" in read_log(log_of(logdir, e))["error"][0]


def test_malformed_stream_chunk_never_leaks_added_fields(stack):
    up, px, logdir = stack
    e = ep()
    bad = chunk(" x", [None], index=None)
    st, body, _ = call(px, e, stream_spec([sse(chunk("Hi", [9707], prompt=PROMPT)), sse(bad),
                                           "data: [DONE]\n\n"]), stream=True)
    assert st == 200 and b"[DONE]" in body
    for line in body.split(b"\n\n"):
        if line.startswith(b"data: {"):
            o = json.loads(line[6:])
            assert o["prompt_token_ids"] is None and o["choices"][0]["token_ids"] is None
            assert o["choices"][0]["logprobs"] is None
    assert end(px, e)[0] == 200
    assert "malformed answer" in read_log(log_of(logdir, e))["error"][0]


# ---- 3. events the proxy cannot parse ------------------------------------------------------------

def test_unparseable_event_says_row_may_miss_tokens(stack):
    up, px, logdir = stack
    e = ep()
    trunc = 'data: {"id":"chatcmpl-1","choices":[{"index":0,"delta":{"content":"x"},"token_ids":[7\n\n'
    st, body, _ = call(px, e, stream_spec([sse(chunk("Hi", [9707], prompt=PROMPT)), trunc, "data: [DONE]\n\n"]),
                       stream=True)
    assert st == 200 and trunc.encode() in body  # passed through as the server sent it
    err = read_log(log_of(logdir, e))["error"][0]
    assert "could not be parsed" in err and "may miss tokens" in err


def test_lone_surrogate_event_is_read(stack):
    up, px, logdir = stack
    e = ep()
    lone = ('data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
            '{"content":"\\ud800"},"logprobs":{"content":[{"token":"x","logprob":-1.0}]},"finish_reason":null,"token_ids":[77]}],'
            '"prompt_token_ids":null}\n\n')
    st, body, _ = call(px, e, stream_spec([sse(chunk("Hi", [9707], prompt=PROMPT)), lone, "data: [DONE]\n\n"]),
                       stream=True)
    assert st == 200 and b'"content":"\\ud800"' in body and b"[77]" not in body
    df = read_log(log_of(logdir, e))
    assert df["error"][0] is None and df["completion_ids"][0].to_list() == [9707, 77]


# ---- 4. "stream": "true" / 1 ----------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["true", 1, "yes"])
def test_loose_stream_flag_is_a_stream(stack, flag):
    up, px, logdir = stack
    e = ep()
    st, body, _ = call(px, e, stream_spec(), stream=flag)
    assert st == 200 and b"[DONE]" in body and b"9707" not in body
    df = read_log(log_of(logdir, e))
    assert df["stream"][0] is True and df["error"][0] is None
    assert df["completion_ids"][0].to_list() == [9707, 1052, 151645]


# ---- 5. secrets in upstream errors ---------------------------------------------------------------

def test_upstream_quoting_credentials_never_reaches_the_log(stack):
    up, px, logdir = stack
    e = ep()
    spec = {"status": 401, "body": '{"error":"bad credentials"}', "quote_request": True}
    st, body, _ = call(px, e, spec, path="/v1/chat/completions?api_key=sk-query-SECRET1&x=1",
                       headers={"authorization": "Bearer sk-header-SECRET2"})
    assert st == 401 and b"sk-header-SECRET2" in body and b"sk-query-SECRET1" in body  # the harness's own
    raw = log_of(logdir, e).read_bytes()
    df = read_log(log_of(logdir, e))
    for secret in ("SECRET1", "SECRET2"):
        assert secret not in (df["error"][0] or "") and secret not in (df["response"][0] or "")
        assert secret.encode() not in raw


def test_json_escaped_secret_key_is_redacted(stack):
    up, px, logdir = stack
    e = ep()
    raw_body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"api\\u005fkey":"sk-escaped-SECRET3"}'
    from .scripted_upstream import answer_header
    r = httpx.post(px.url + "/v1/chat/completions", content=raw_body, timeout=30,
                   headers={"content-type": "application/json", "x-polar-episode": e,
                            "x-answer": answer_header(ok_spec())})
    assert r.status_code == 200
    df = read_log(log_of(logdir, e))
    assert "SECRET3" not in df["request"][0] and "[redacted]" in df["request"][0]


# ---- 6. /end validation --------------------------------------------------------------------------

@pytest.mark.parametrize("reward", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"9" * 400])
def test_end_rejects_non_finite_rewards(stack, reward):
    up, px, logdir = stack
    e = ep()
    assert call(px, e, ok_spec())[0] == 200
    n = up.record.read_text().count("\n")
    st, body = end(px, e, b'{"reward": ' + reward + b"}")
    assert st == 400 and "reward" in json.loads(body)["error"]["message"]  # valid JSON
    assert up.record.read_text().count("\n") == n  # never forwarded
    assert not read_head(log_of(logdir, e)).finished
    assert end(px, e, {"reward": 0.5})[0] == 200  # the episode is still open


# ---- 7. the harness's own return_token_ids on a vLLM chat stream ---------------------------------

def test_harness_return_token_ids_keeps_empty_delta_chunks(stack):
    up, px, logdir = stack
    e = ep()
    chunks = [sse(chunk("Hi", [9707], prompt=PROMPT)), sse(chunk(None, [151667])),
              sse(chunk("", [151645], finish="stop")), "data: [DONE]\n\n"]
    st, body, _ = call(px, e, stream_spec(chunks), {**CHAT, "return_token_ids": True}, stream=True)
    events = [json.loads(x[6:]) for x in body.split(b"\n\n") if x.startswith(b"data: {")]
    assert len(events) == 3 and events[1]["choices"][0]["delta"] == {}
    assert [ev["choices"][0]["token_ids"] for ev in events] == [[9707], [151667], [151645]]  # its own ids
    assert events[0]["prompt_token_ids"] == PROMPT


# ---- 8. huge n -----------------------------------------------------------------------------------

def test_huge_n_is_refused(stack):
    up, px, logdir = stack
    e = ep()
    t = time.monotonic()
    st, body, _ = call(px, e, ok_spec(), {**CHAT, "n": 200000})
    assert st == 400 and b"polar_max_choices" in json.loads(body)["error"]["message"].encode()
    assert time.monotonic() - t < 5
    df = read_log(log_of(logdir, e))
    assert len(df) == 1 and "n=200000" in df["error"][0]
    assert log_of(logdir, e).stat().st_size < 100_000


# ---- 9. kill -9 after the harness saw [DONE] -----------------------------------------------------

def test_sigkill_after_done_keeps_the_call(tmp_path):
    logdir = tmp_path / "logs"
    with scripted(tmp_path) as up, proxy(tmp_path, logdir, up.url) as px:
        e = ep()
        from .scripted_upstream import answer_header
        h = {"content-type": "application/json", "x-polar-episode": e,
             "x-answer": answer_header(stream_spec(hold_s=30))}
        got = b""
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", px.url + "/v1/chat/completions", headers=h,
                          content=json.dumps({**CHAT, "stream": True}).encode()) as r:
                for part in r.iter_raw():
                    got += part
                    if b"[DONE]" in got:
                        break
                os.kill(px.pid, signal.SIGKILL)
        px.proc.wait(10)
    df = read_log(log_of(logdir, e))
    assert len(df) == 1 and df["error"][0] is None
    assert df["completion_ids"][0].to_list() == [9707, 1052, 151645]


# ---- 10. rewritten events are byte-faithful ------------------------------------------------------

def test_rewritten_bytes_keep_floats_ids_and_sse_fields(stack):
    up, px, logdir = stack
    e = ep()
    first = ('id: 1\nevent: message\ndata: {"id":"c","choices":[{"index":0,"delta":{"content":"Hi"},'
             '"logprobs":{"content":[{"token":"Hi","logprob":-1.19e-7,"bytes":[72,105],"top_logprobs":[]}]},'
             '"finish_reason":null,"token_ids":[9707]}],"prompt_token_ids":[1,2]}\n\n')
    want = first.replace('"token_ids":[9707]', '"token_ids":null').replace('"prompt_token_ids":[1,2]',
                                                                            '"prompt_token_ids":null')
    st, body, _ = call(px, e, stream_spec([first, "data: [DONE]\n\n"]), {**CHAT, "logprobs": True}, stream=True)
    assert body == want.encode() + b"data: [DONE]\n\n"
    # whole answers too
    raw = ('{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"logprobs":{"content":'
           '[{"token":"Hi","logprob":-1.19e-7}]},"finish_reason":"stop","token_ids":[9707]}],'
           '"prompt_token_ids":[1,2],"usage":{"prompt_tokens":2}}')
    st, body, _ = call(px, e, {"status": 200, "body": raw}, {**CHAT, "logprobs": True})
    assert body.decode() == raw.replace('"token_ids":[9707]', '"token_ids":null').replace(
        '"prompt_token_ids":[1,2]', '"prompt_token_ids":null')
    # a request's integers past 64 bits reach the server exact
    big = 123456789012345678901234567890
    call(px, e, ok_spec(), {**CHAT, "seed": big, "logprobs": False})
    sent = json.loads(json.loads(up.record.read_text().splitlines()[-1])["body"])
    assert sent["seed"] == big and sent["logprobs"] is True


# ---- 11. malformed Messages / Responses / Gemini requests -------------------------------------------------

@pytest.mark.parametrize("path,body,shape", [
    ("/v1/responses", {"model": "m", "input": "hi", "tools": "x"}, "openai"),
    ("/v1/responses", {"model": "m", "input": "hi", "text": 1}, "openai"),
    ("/v1/messages", {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [1]}, "anthropic"),
    ("/v1beta/models/m:streamGenerateContent?alt=sse",
     {"contents": [{"role": "user", "parts": [{"inlineData": {"mimeType": "image/png", "data": "AA"}}]}]}, "gemini"),
    ("/v1beta/models/m:generateContent", {"contents": [{"role": "user", "parts": "hi"}]}, "gemini"),
    ("/v1beta/models/m:generateContent", {"contents": [{"role": "user", "parts": [{"text": "hi"}]}],
                                          "tools": [{"functionDeclarations": [1]}]}, "gemini"),
])
def test_malformed_translated_requests_get_400(stack, path, body, shape):
    up, px, logdir = stack
    e = ep()
    st, out, _ = call(px, e, ok_spec(), body, path=path)
    assert st == 400, out
    obj = json.loads(out)
    if shape == "anthropic":
        assert obj["type"] == "error" and obj["error"]["type"] == "invalid_request_error"
    elif shape == "gemini":
        assert obj["error"]["code"] == 400 and obj["error"]["status"] == "INVALID_ARGUMENT", obj
        assert "parts" in obj["error"]["message"] or "malformed request" in obj["error"]["message"], obj
    else:
        assert "malformed request" in obj["error"]["message"]


# ---- 12. SIGTERM ---------------------------------------------------------------------------------

def test_sigterm_writes_interrupted_row_before_end_record(tmp_path):
    logdir = tmp_path / "logs"
    with scripted(tmp_path) as up, proxy(tmp_path, logdir, up.url, polar_end_wait_ms=100) as px:
        e = ep()
        from .scripted_upstream import answer_header
        spec = stream_spec(good_stream()[:1], hold_s=60)
        h = {"content-type": "application/json", "x-polar-episode": e, "x-answer": answer_header(spec)}
        started = threading.Event()

        def harness():
            try:
                with httpx.Client(timeout=60) as c, c.stream(
                        "POST", px.url + "/v1/chat/completions", headers=h,
                        content=json.dumps({**CHAT, "stream": True}).encode()) as r:
                    for _ in r.iter_raw():
                        started.set()
            except httpx.HTTPError:
                pass

        th = threading.Thread(target=harness, daemon=True)
        th.start()
        assert started.wait(20)
        st, body = end(px, e, {"reward": 1.0})
        assert st == 202
        px.proc.send_signal(signal.SIGTERM)
        px.proc.wait(20)
        th.join(20)
        out = px.output()
    kinds = [r["kind"] for r in rows_of(log_of(logdir, e))]
    assert kinds == ["call", "end"], kinds
    assert "shut down" in read_log(log_of(logdir, e))["error"][0]
    # No traceback at all: not the addon's, and not CPython 3.11's asyncio one per connection cut at
    # exit (streams.py's client_connected_cb callback; bare mitmdump prints it), which the addon's
    # quiet shutdown drops (mitmproxy_patches.py).
    assert "Traceback" not in out, out
    assert "could not log" not in out and "polar:" not in out, out


# ---- 13. compressed request bodies are bounded by their decompressed size -------------------------

def test_compressed_bombs_are_refused_not_inflated(tmp_path):
    """A 30 KB gzip body that inflates to 32 MB: 413 naming the bound, never forwarded, no row; zstd
    the same; the same for a control request (bounded by polar_max_control_body); a body under
    the bound is still decoded, captured and answered."""
    import gzip

    import zstandard

    logdir = tmp_path / "logs"
    with scripted(tmp_path) as up, proxy(tmp_path, logdir, up.url, polar_max_body=4 * 2**20) as px:
        from .scripted_upstream import answer_header
        h = {"content-type": "application/json", "x-answer": answer_header(ok_spec())}
        bomb_json = b'{"model":"m","messages":[{"role":"user","content":"' + b"a" * (32 * 2**20) + b'"}]}'
        e = ep()
        for enc, data in (("gzip", gzip.compress(bomb_json, 6)), ("zstd", zstandard.ZstdCompressor().compress(bomb_json))):
            assert len(data) < 2**20
            rss = int(open(f"/proc/{px.pid}/status").read().split("VmRSS:")[1].split()[0])
            r = httpx.post(px.url + "/v1/chat/completions", content=data,
                           headers={**h, "content-encoding": enc, "x-polar-episode": e}, timeout=60)
            assert r.status_code == 413 and "decompresses to more than 4194304 bytes" in r.text, r.text
            after = int(open(f"/proc/{px.pid}/status").read().split("VmRSS:")[1].split()[0])
            assert after - rss < 20_000, (rss, after)  # KiB: never inflated to 32 MB
        r = httpx.post(px.url + "/v1/chat/completions", content=b"x", timeout=30,
                       headers={**h, "content-encoding": "br", "x-polar-episode": e})
        assert r.status_code in (413, 415), r.text
        end_bomb = gzip.compress(b'{"reward": 1, "metadata": {"x": "' + b"b" * 2**20 + b'"}}')
        r = httpx.post(f"{px.url}/polar/{e}/end", content=end_bomb, headers={"content-encoding": "gzip"}, timeout=30)
        assert r.status_code == 413 and "polar_max_control_body" in r.text, r.text
        assert not up.record.exists() or up.record.read_text() == ""  # nothing was forwarded
        assert not log_of(logdir, e).exists()
        ok = gzip.compress(json.dumps(CHAT).encode())
        r = httpx.post(px.url + "/v1/chat/completions", content=ok, timeout=30,
                       headers={**h, "content-encoding": "gzip", "x-polar-episode": e})
        assert r.status_code == 200, r.text
        assert end(px, e, {"reward": 1.0})[0] == 200
    df = read_log(log_of(logdir, e))
    assert len(df) == 1 and df["error"][0] is None and df["completion_ids"][0].to_list() == [9707]
    refused = [json.loads(x) for x in (logdir / "refused.jsonl").read_text().splitlines()]
    assert [x["status"] for x in refused][:2] == [413, 413]
