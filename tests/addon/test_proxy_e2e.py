"""The addon in a real mitmdump process, against the fake backend (bench/fake_backend.py): the
wire shapes of both dialects and the failure modes a real server rarely produces on demand."""
from __future__ import annotations

import asyncio
import gzip
import json
import signal
import ssl
import subprocess
import time
import uuid

import httpx
import pytest

from polar_contracts.log.reader import read_episode, read_log
from polar_contracts.weight_versions import is_proxy_version

from .procs import fake_backend, mitmdump

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "héllo"}]}
COMP = {"model": "fake-model", "prompt": "once upon"}


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def stack(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"e2e-{request.param}")
    logdir = work / "logs"
    with fake_backend(work, request.param, chunks=12) as be, mitmdump(work, logdir, upstream=be.url) as px:
        yield request.param, be, px, logdir


def ep() -> str:
    return "t-" + uuid.uuid4().hex[:10]


def post(url, body, episode=None, headers=None, stream=False):
    h = {"content-type": "application/json", **({"x-polar-episode": episode} if episode else {}), **(headers or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(timeout=30) as c:
        if stream:
            with c.stream("POST", url, content=data, headers=h) as r:
                return r.status_code, b"".join(r.iter_raw()), r.headers
        r = c.post(url, content=data, headers=h)
        return r.status_code, r.content, r.headers


def server_ids(be, api, body, dialect):
    """What the server itself says the ids are (asked directly, with the flags, non-streaming)."""
    flags = {"return_token_ids": True} if dialect == "vllm" or api == "completions" else {
        "return_prompt_token_ids": True, "return_token_ids": True}
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    _, raw, _ = post(be.url + path, {**body, "stream": False, **flags})
    obj = json.loads(raw)
    ch = obj["choices"][0]
    prompt = obj.get("prompt_token_ids") or ch.get("prompt_token_ids")
    comp = ch.get("token_ids") or ch.get("response_token_ids")
    return prompt, comp


@pytest.mark.parametrize("api", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_matrix_bytes_and_ids(stack, api, stream):
    dialect, be, px, logdir = stack
    body = {**(CHAT if api == "chat" else COMP), "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    e = ep()
    st_direct, direct, _ = post(be.url + path, body, stream=stream)
    st_proxy, proxied, hdrs = post(px.url + path, body, episode=e, stream=stream)
    assert st_direct == st_proxy == 200
    assert proxied == direct  # the harness cannot tell the proxy is there
    df = read_log(logdir / f"{e}.arrow")
    assert df.height == 1
    row = df.row(0, named=True)
    assert row["error"] is None and row["status"] == 200 and row["api"] == api and row["dialect"] == dialect
    prompt, comp = server_ids(be, api, body, dialect)
    assert row["prompt_ids"] == prompt and row["completion_ids"] == comp
    assert len(row["completion_logprobs"]) == len(comp)
    # SGLang non-stream chat: meta_info (asked for by the proxy) names the weights; no header here.
    # Otherwise the fake backend names none (no version route): the proxy's own name, never null
    if (dialect, api, stream) == ("sglang", "chat", False):
        assert row["weight_version"] == "fake-v1"
    else:
        assert is_proxy_version(row["weight_version"]) and row["weight_version"].endswith("-0"), row["weight_version"]
    assert row["request"] == json.dumps(body)
    resp = json.loads(row["response"])
    text = resp["choices"][0]["message"]["content"] if api == "chat" else resp["choices"][0]["text"]
    assert text.startswith("Héllold 日本")


def test_harness_logprobs_survive(stack):
    dialect, be, px, logdir = stack
    body = {**CHAT, "stream": True, "logprobs": True}
    _, direct, _ = post(be.url + "/v1/chat/completions", body, stream=True)
    _, proxied, _ = post(px.url + "/v1/chat/completions", body, episode=ep(), stream=True)
    assert proxied == direct and b'"logprob":' in proxied


def test_upstream_500_passes_and_is_recorded(stack):
    _, be, px, logdir = stack
    e = ep()
    body = {**CHAT, "stream": True}
    d = post(be.url + "/v1/chat/completions", body, headers={"x-fake": "error500"})
    p = post(px.url + "/v1/chat/completions", body, episode=e, headers={"x-fake": "error500"})
    assert p[0] == d[0] == 500 and p[1] == d[1]
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert row["status"] == 500 and "upstream status 500" in row["error"] and row["completion_ids"] is None


def test_reset_mid_stream_same_failure_and_recorded(stack):
    _, be, px, logdir = stack
    e = ep()
    body = {**CHAT, "stream": True}
    for url, hdr in ((be.url, {}), (px.url, {"x-polar-episode": e})):
        with pytest.raises(httpx.RemoteProtocolError):
            post(url + "/v1/chat/completions", body, headers={"x-fake": "reset", **hdr}, stream=True)
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert "mid-stream" in row["error"]
    # and the proxy keeps serving
    assert post(px.url + "/v1/chat/completions", CHAT, episode=e)[0] == 200


def test_no_ids_is_an_explicit_error(stack):
    _, be, px, logdir = stack
    e = ep()
    for stream in (False, True):
        _, direct, _ = post(be.url + "/v1/chat/completions", {**CHAT, "stream": stream}, stream=stream)
        st, got, _ = post(px.url + "/v1/chat/completions", {**CHAT, "stream": stream}, episode=e,
                          headers={"x-fake": "noids"}, stream=stream)
        assert st == 200
    df = read_log(logdir / f"{e}.arrow")
    for row in df.iter_rows(named=True):
        assert "no completion token ids" in row["error"]
        assert row["completion_ids"] is None and row["prompt_ids"] is None


def test_crlf_keepalives_split_utf8(stack):
    dialect, be, px, logdir = stack
    e = ep()
    body = {**CHAT, "stream": True}
    _, direct, _ = post(be.url + "/v1/chat/completions", body, headers={"x-fake": "crlf"}, stream=True)
    _, proxied, _ = post(px.url + "/v1/chat/completions", body, episode=e, headers={"x-fake": "crlf"}, stream=True)
    assert proxied == direct and b": keep-alive\r\n\r\n" in proxied
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert row["error"] is None and row["completion_ids"] == server_ids(be, "chat", body, dialect)[1]


def test_client_disconnect_mid_stream(stack):
    _, be, px, logdir = stack
    e = ep()
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", px.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"x-polar-episode": e, "x-fake": "slow"}) as r:
            next(r.iter_raw())
    deadline = time.time() + 10
    while time.time() < deadline and not (logdir / f"{e}.arrow").exists():
        time.sleep(0.1)
    while time.time() < deadline and read_log(logdir / f"{e}.arrow").height == 0:
        time.sleep(0.1)
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert "disconnect" in row["error"].lower()
    assert post(px.url + "/v1/chat/completions", CHAT, episode=e)[0] == 200


def test_bad_inputs(stack):
    _, be, px, logdir = stack
    e = ep()
    # malformed JSON: the server's own answer reaches the harness; the row says what happened
    d = post(be.url + "/v1/chat/completions", b'{"model": ')
    p = post(px.url + "/v1/chat/completions", b'{"model": ', episode=e)
    assert p[:2] == d[:2]
    # a gzip-compressed body is decoded, rewritten and re-compressed
    body = {**CHAT, "stream": True}
    st, got, _ = post(px.url + "/v1/chat/completions", gzip.compress(json.dumps(body).encode()), episode=e,
                      headers={"content-encoding": "gzip"}, stream=True)
    assert st == 200 and got.endswith(b"data: [DONE]\n\n")
    # a 10 MB body
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (10 * 1024 * 1024)}]}
    assert post(px.url + "/v1/chat/completions", big, episode=e)[0] == 200
    rows = read_log(logdir / f"{e}.arrow").to_dicts()
    assert "not valid JSON" in rows[0]["error"]
    assert rows[1]["error"] is None and rows[1]["completion_ids"]
    assert rows[2]["error"] is None and len(rows[2]["request"]) > 10 * 1024 * 1024
    # malformed JSON that looks like an object ({...}): passed through as it came
    broken = b'{"model": "m", "messages": [}'
    d = post(be.url + "/v1/chat/completions", broken)
    p = post(px.url + "/v1/chat/completions", broken, episode=e)
    assert p[0] == d[0] == 400
    rows = read_log(logdir / f"{e}.arrow").to_dicts()
    assert "not valid JSON" in rows[3]["error"] and rows[3]["request"] == broken.decode()
    # ... and one that names a secret key: its text is not logged at all
    post(px.url + "/v1/chat/completions", b'{"api_key": "sk-secret-123", "messages": [}', episode=e)
    rows = read_log(logdir / f"{e}.arrow").to_dicts()
    assert "sk-secret-123" not in rows[4]["request"] and "not logged" in rows[4]["request"]
    assert b"sk-secret-123" not in (logdir / f"{e}.arrow").read_bytes()


def test_invalid_episode_id_400_nothing_on_disk(stack):
    _, be, px, logdir = stack
    before = set(p.name for p in logdir.iterdir())
    st, raw, _ = post(px.url + "/v1/chat/completions", CHAT, headers={"x-polar-episode": "../../etc/x"})
    assert st == 400 and b"invalid episode id" in raw
    st, raw, _ = post(px.url + "/polar/..%2F..%2Fx/v1/chat/completions", CHAT)
    assert st == 400 and b"invalid episode id" in raw
    # no log file: only the refusals' own record
    assert set(p.name for p in logdir.iterdir()) - before <= {"refused.jsonl"}
    assert not list(logdir.parent.parent.glob("**/x.arrow"))
    refused = [json.loads(line) for line in (logdir / "refused.jsonl").read_text().splitlines()]
    assert sum("invalid episode id" in r["reason"] and r["status"] == 400 for r in refused) >= 2


def test_model_listing_passes_untouched_other_paths_refused(stack):
    """GET /v1/models goes upstream (not logged as a call); any path that is not the model API is
    refused by the proxy itself (403, JSON), whatever it is."""
    _, be, px, logdir = stack
    before = {p.name: p.stat().st_size for p in logdir.iterdir() if p.name != "refused.jsonl"}
    with httpx.Client() as c:
        assert c.get(px.url + "/v1/models").json() == c.get(be.url + "/v1/models").json()
        r = c.head(px.url + "/")
        assert r.status_code == 403
        r = c.get(px.url + "/tokenize")
        assert r.status_code == 403 and "not a model API route" in r.json()["error"]["message"]
    assert {p.name: p.stat().st_size for p in logdir.iterdir() if p.name != "refused.jsonl"} == before


def test_secrets_never_logged(stack):
    _, be, px, logdir = stack
    e = ep()
    body = {**CHAT, "api_key": "sk-SECRET-1", "metadata": {"x-api-key": "sk-SECRET-2"}}
    post(px.url + "/v1/chat/completions", body, episode=e,
         headers={"authorization": "Bearer sk-SECRET-3", "x-api-key": "sk-SECRET-4", "api-key": "sk-SECRET-5"})
    raw = (logdir / f"{e}.arrow").read_bytes()
    df = read_log(logdir / f"{e}.arrow")
    text = json.dumps(df.drop("completion_logprobs").to_dicts(), default=str)
    assert "SECRET" not in text and b"SECRET" not in raw
    assert json.loads(df["request"][0])["api_key"] == "[redacted]"


def test_end_endpoint_and_routing(stack):
    _, be, px, logdir = stack
    e = ep()
    assert post(px.url + f"/polar/{e}/v1/chat/completions", CHAT)[0] == 200
    st, raw, _ = post(px.url + f"/polar/{e}/end", {"reward": 0.5, "metadata": {"task": "t1"}})
    assert st == 200 and json.loads(raw) == {"episode_id": e, "calls": 1, "reward": 0.5, "ended": True}
    ep_log = read_episode(logdir / f"{e}.arrow")
    assert ep_log.finished and ep_log.reward == 0.5 and ep_log.metadata == {"task": "t1"}
    assert ep_log.calls.height == 1
    st, raw, _ = post(px.url + f"/polar/{e}/end", {"reward": 1})
    assert st == 409
    st, raw, _ = post(px.url + f"/polar/{ep()}/end", {"reward": "high"})
    assert st == 400 and b"reward must be a number" in raw
    # calls after the end are refused clearly, not lost
    st, raw, _ = post(px.url + "/v1/chat/completions", CHAT, episode=e)
    assert st == 409 and b"already ended" in raw


def test_64_concurrent_streaming_episodes_not_mixed(stack):
    dialect, be, px, logdir = stack
    episodes = [ep() for _ in range(64)]

    async def one(client, e, k):
        body = {"model": "fake-model", "stream": True,
                "messages": [{"role": "user", "content": f"episode {e} says {'z' * (k * 13)}"}]}
        async with client.stream("POST", px.url + "/v1/chat/completions", json=body,
                                 headers={"x-polar-episode": e}) as r:
            assert r.status_code == 200
            return body, b"".join([c async for c in r.aiter_raw()])

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            return await asyncio.gather(*(one(c, e, k) for k, e in enumerate(episodes)))

    results = asyncio.run(main())
    for e, (body, raw) in zip(episodes, results, strict=True):
        assert raw.endswith(b"data: [DONE]\n\n")
        df = read_log(logdir / f"{e}.arrow")
        assert df.height == 1
        row = df.row(0, named=True)
        assert row["error"] is None and json.loads(row["request"]) == body
        assert row["prompt_ids"] == server_ids(be, "chat", body, dialect)[0]


def test_sigkill_mid_episode_keeps_completed_calls(tmp_path):
    logdir = tmp_path / "logs"
    with fake_backend(tmp_path, "vllm", chunks=12) as be:
        with mitmdump(tmp_path, logdir, upstream=be.url) as px:
            e = ep()
            for _ in range(3):
                assert post(px.url + "/v1/chat/completions", {**CHAT, "stream": True}, episode=e, stream=True)[0] == 200
            # one call in flight when the proxy dies
            proc = subprocess.Popen(["curl", "-s", "-N", "-H", f"x-polar-episode: {e}", "-H", "x-fake: slow", "-d",
                                     json.dumps({**CHAT, "stream": True}), px.url + "/v1/chat/completions"],
                                    stdout=subprocess.DEVNULL)
            time.sleep(0.3)
            px.proc.send_signal(signal.SIGKILL)
            px.proc.wait()
            proc.wait(10)
        ep_log = read_episode(logdir / f"{e}.arrow")
        assert ep_log.calls.height == 3 and not ep_log.finished
        assert all(r is not None for r in ep_log.calls["completion_ids"].to_list())
        # a restarted proxy appends to the same episode
        with mitmdump(tmp_path, logdir, upstream=be.url) as px2:
            assert post(px2.url + "/v1/chat/completions", CHAT, episode=e)[0] == 200
            assert post(px2.url + f"/polar/{e}/end", {"reward": 1.0})[0] == 200
        ep_log = read_episode(logdir / f"{e}.arrow")
        assert ep_log.finished and ep_log.calls["call_index"].to_list() == [0, 1, 2, 3]


def test_forward_proxy_https_with_upstream(tmp_path):
    """Harness talks HTTPS to a host of its choosing through the proxy (trusting mitmproxy's CA);
    polar_upstream sends its model calls to the inference server."""
    logdir = tmp_path / "logs"
    with fake_backend(tmp_path, "vllm", chunks=6) as be:
        with mitmdump(tmp_path, logdir, mode="regular",
                      sets={"polar_upstream": be.url, "connection_strategy": "lazy", "polar_episode": "fwd"}) as px:
            ca = tmp_path / "mitmconf" / "mitmproxy-ca-cert.pem"
            deadline = time.time() + 10
            while not ca.exists() and time.time() < deadline:
                time.sleep(0.1)
            body = {**CHAT, "stream": True}
            with httpx.Client(proxy=px.url, verify=ssl.create_default_context(cafile=str(ca)), timeout=30) as c:
                with c.stream("POST", "https://api.inference.invalid/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    got = b"".join(r.iter_raw())
                models = c.get("https://api.inference.invalid/v1/models")
                assert models.json()["data"][0]["owned_by"] == "vllm"
            _, direct, _ = post(be.url + "/v1/chat/completions", body, stream=True)
            assert got == direct
        row = read_log(logdir / "fwd.arrow").row(0, named=True)
        assert row["error"] is None and row["completion_ids"] == server_ids(be, "chat", body, "vllm")[1]


def test_forward_proxy_without_upstream_refuses_other_destinations(tmp_path):
    """Forward-proxy mode without polar_upstream: the client names the host, so only the hosts of
    polar_allowed_hosts may be named; any other destination (plain request or CONNECT) is 403,
    logged, and never connected to (a canary listener on this host's loopback sees nothing)."""
    import socket
    import threading

    canary = socket.socket()
    canary.bind(("127.0.0.1", 0))
    canary.listen(8)
    canary.settimeout(0.2)
    seen: list = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                seen.append(canary.accept()[0])
            except OSError:
                pass
    threading.Thread(target=watch, daemon=True).start()
    cport = canary.getsockname()[1]
    logdir = tmp_path / "logs"
    try:
        with fake_backend(tmp_path, "vllm", chunks=3) as be:
            allowed = be.url.removeprefix("http://")
            with mitmdump(tmp_path, logdir, mode="regular",
                          sets={"polar_allowed_hosts": allowed, "connection_strategy": "lazy",
                                "polar_episode": "fwd"}) as px:
                with httpx.Client(proxy=px.url, timeout=30) as c:
                    for path in ("/v1/chat/completions", "/v1/models"):
                        r = c.post(f"http://127.0.0.1:{cport}{path}", json=CHAT) if "chat" in path else \
                            c.get(f"http://127.0.0.1:{cport}{path}")
                        assert r.status_code == 403 and "not the inference server" in r.text, r.text
                    r = c.post(f"{be.url}/v1/chat/completions", json=CHAT)  # the allowed server
                    assert r.status_code == 200, r.text
                with httpx.Client(proxy=px.url, verify=False, timeout=30) as c:
                    with pytest.raises(httpx.ProxyError, match="403"):
                        c.get(f"https://127.0.0.1:{cport}/v1/models")
            time.sleep(0.5)
        assert seen == []
        refused = [json.loads(x) for x in (logdir / "refused.jsonl").read_text().splitlines()]
        assert [x["status"] for x in refused] == [403, 403, 403]
        assert read_log(logdir / "fwd.arrow")["error"][0] is None
    finally:
        stop.set()
        canary.close()
        for s in seen:
            s.close()


def test_upstream_down_is_recorded(tmp_path):
    """No server at all. With connection_strategy=lazy the request is read first: the harness gets
    mitmproxy's 502 and the row says why. (With the default eager strategy mitmproxy closes the
    harness's connection before any request exists: nothing to log, same as bare mitmdump.)"""
    from .procs import free_port

    logdir = tmp_path / "logs"
    with mitmdump(tmp_path, logdir, upstream=f"http://127.0.0.1:{free_port()}",
                  sets={"polar_dialect": "vllm", "connection_strategy": "lazy"}) as px:
        e = ep()
        st, raw, _ = post(px.url + "/v1/chat/completions", CHAT, episode=e)
        assert st == 502
        row = read_log(logdir / f"{e}.arrow").row(0, named=True)
        assert row["status"] is None and "connection failed before a response" in row["error"]
        assert row["completion_ids"] is None
        assert post(px.url + "/v1/chat/completions", CHAT, episode=e)[0] == 502  # still serving


def test_long_growing_prompts_ids_exact(stack):
    """Prompt id lists of 10k+ ids, growing call by call in one episode (the proxy reuses the
    episode's previous list bytes, idlists.py): the harness's bytes and the logged ids are exact."""
    dialect, be, px, logdir = stack
    e = ep()
    msgs = [{"role": "user", "content": "x" * 40000}]
    n = 0
    for turn in range(3):
        for stream in (False, True):
            if dialect == "sglang" and stream:
                continue  # SGLang streams carry ids in sglext, not prompt_token_ids
            body = {"model": "fake-model", "messages": msgs, "stream": stream}
            st_d, direct, _ = post(be.url + "/v1/chat/completions", body, stream=stream)
            st_p, proxied, _ = post(px.url + "/v1/chat/completions", body, episode=e, stream=stream)
            assert st_d == st_p == 200 and proxied == direct
            row = read_log(logdir / f"{e}.arrow").row(n, named=True)
            n += 1
            prompt, comp = server_ids(be, "chat", body, dialect)
            assert len(prompt) > 10000 and row["error"] is None
            assert row["prompt_ids"] == prompt and row["completion_ids"] == comp
        msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "y" * (1000 * (turn + 1))}]
