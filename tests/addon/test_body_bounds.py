"""Nothing one episode sends blocks the proxy: a gzip bomb and deeply nested JSON are answered 400
before anything parses them, a large or compressed body is read in a worker thread (the event loop
serves a sibling meanwhile), one body at a time per episode with a byte budget, and a bound on an
episode's calls in flight. Structural checks, no timing: the parsers are made to fail if called,
and a worker is held on an event while a sibling's call goes through."""
from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest
from mitmproxy.test import taddons

from addon import body_shape, body_work, jsonhead
from addon import call as calls
from addon.polar_addon import make_addons
from polar_contracts.control import capability
from polar_contracts.control import json_depth as reference_depth

from .test_control_addons import SECRET, request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(autouse=True)
def loop():
    lp = asyncio.new_event_loop()
    asyncio.set_event_loop(lp)
    yield lp
    asyncio.set_event_loop(None)
    lp.close()


@pytest.fixture
def proxy(tmp_path):
    addons = make_addons()
    with taddons.context(*addons) as tctx:
        tctx.options.update(polar_logdir=str(tmp_path / "logs"), polar_control_secret=SECRET, polar_dialect="vllm",
                            polar_logprobs_mode="unknown", polar_server_kind="polar-serve")
        yield addons, tctx


@pytest.fixture
def no_parse(monkeypatch):
    """Every JSON parse of a model call fails the test: a refusal must come before any."""
    def parsed(*a, **k):
        raise AssertionError("the body was parsed")
    monkeypatch.setattr(calls, "loads_request", parsed)
    monkeypatch.setattr(calls, "request_head", parsed)
    monkeypatch.setattr(jsonhead, "request_head", parsed)


def path(e: str) -> str:
    return f"/polar/{capability(SECRET, e)}/v1/chat/completions"


def bomb(n: int) -> bytes:
    """The issue's shape: many tiny objects and a repeated key (which sends a body past simdjson)."""
    return b'{"model":"m","model":"m","messages":[' + b"{}," * n + b"{}]}"


def error_of(f) -> tuple[int, str]:
    return f.response.status_code, json.loads(f.response.content)["error"]["message"]


def test_gzip_bomb_is_400_before_any_parse(proxy, no_parse, caplog):
    addons, tctx = proxy
    tctx.options.update(polar_max_json_elements=100_000)
    # (mitmproxy compresses the body it is given as the content-encoding says)
    f = request(addons, "POST", path("e-bomb"), bomb(200_000), {"content-encoding": "gzip",
                                                                 "content-type": "application/json"})
    assert len(f.request.raw_content) < 5000
    st, msg = error_of(f)
    assert st == 400 and "polar_max_json_elements" in msg and "400006 JSON values" in msg
    mac = capability(SECRET, "e-bomb").split("~")[1]
    assert "refused POST /polar/e-bomb~[redacted]/" in caplog.text and mac not in caplog.text  # (the proxy's log)


@pytest.mark.parametrize("depth", [129, 1000, 200_000])
def test_large_nested_json_is_400_before_any_parse(proxy, no_parse, depth):
    """A body of OFFLOAD_BYTES or more is measured (in a worker thread) before anything parses it."""
    addons, _ = proxy
    pad = b" " * body_work.OFFLOAD_BYTES
    body = b'{"model":"m","messages":[],"x":' + b"[" * depth + pad + b"]" * depth + b"}"
    f = request(addons, "POST", path("e-deep"), body, {"content-type": "application/json"})
    st, msg = error_of(f)
    assert st == 400 and "polar_max_json_depth" in msg


@pytest.mark.parametrize("depth", [2000, 100_000])
def test_small_nested_json_is_400_not_500(proxy, depth):
    """A small body is not measured: past the parsers' depth limit the capture answers 400 (the json
    module's RecursionError was a 500 with a traceback)."""
    addons, _ = proxy
    body = b'{"model":"m","messages":[],"x":' + b"[" * depth + b"]" * depth + b"}"
    assert len(body) < body_work.OFFLOAD_BYTES
    f = request(addons, "POST", path("e-deep"), body, {"content-type": "application/json"})
    st, msg = error_of(f)
    assert st == 400 and "too deeply" in msg


def test_depth_below_the_bound_still_passes_to_the_capture(proxy):
    addons, _ = proxy
    body = json.dumps({**CHAT, "x": json.loads("[" * 120 + "]" * 120), "pad": " " * body_work.OFFLOAD_BYTES}).encode()
    f = request(addons, "POST", path("e-ok"), body, {"content-type": "application/json"})
    assert f.response is None  # forwarded (the capture prepared it)


def test_recursion_in_the_capture_is_a_400(proxy, monkeypatch):
    """Belt and braces: were a parse to recurse too deep after all, the call gets 400, not 500."""
    addons, _ = proxy
    def deep(*a, **k):
        raise RecursionError("maximum recursion depth exceeded")
    monkeypatch.setattr(calls, "prepare", deep)
    f = request(addons, "POST", path("e-rec"), json.dumps(CHAT).encode(), {"content-type": "application/json"})
    st, msg = error_of(f)
    assert st == 400 and "too deeply" in msg


def test_a_compressed_body_is_read_off_the_loop_while_a_sibling_is_served(proxy, monkeypatch):
    """The adversary's body is held in the worker thread; the sibling's call goes through meanwhile
    (its hooks finish on the event loop), then the adversary's is refused."""
    addons, tctx = proxy
    tctx.options.update(polar_max_json_elements=100_000)
    entered, release = threading.Event(), threading.Event()
    threads = []
    real = body_work.read_body

    def held(*a):
        if a[1] is None:  # (the sibling's small body, read inline)
            return real(*a)
        threads.append(threading.get_ident())
        entered.set()
        assert release.wait(30)
        return real(*a)
    monkeypatch.setattr(body_work, "read_body", held)
    from mitmproxy.proxy.mode_specs import ProxyMode
    from mitmproxy.test import tflow

    def flow(p, body, headers):
        f = tflow.tflow()
        f.client_conn.proxy_mode = ProxyMode.parse("reverse:http://address:22")
        f.request.method, f.request.path = "POST", p
        f.request.headers.clear()
        for k, v in headers.items():
            f.request.headers[k] = v
        f.request.content = body
        return f

    async def hooks(f):
        for a in addons:
            if hasattr(a, "request"):
                r = a.request(f)
                if asyncio.iscoroutine(r):
                    await r

    async def scenario():
        bad = flow(path("e-adv"), bomb(200_000), {"content-encoding": "gzip"})  # (compressed by mitmproxy)
        sibling = flow(path("e-sib"), json.dumps(CHAT).encode(), {"content-type": "application/json"})
        adv = asyncio.ensure_future(hooks(bad))
        while not entered.is_set():
            await asyncio.sleep(0.001)
        await asyncio.wait_for(hooks(sibling), 30)  # served while the adversary's body is in the worker
        assert not adv.done() and sibling.response is None
        release.set()
        await adv
        return bad
    bad = asyncio.get_event_loop().run_until_complete(scenario())
    assert threads and threads[0] != threading.get_ident()
    assert error_of(bad)[0] == 400


def test_an_episode_reads_one_body_at_a_time_within_its_byte_budget(monkeypatch):
    """A second body of the same episode waits for the first; past the episode's byte budget a call
    is refused (EpisodeBusy: 429); another episode's body is not queued behind them."""
    work = body_work.BodyWork(max_pending=3 * 300_000)
    limits = body_work.BodyLimits(10**8, 10**6, 128)
    active: dict[str, int] = {}
    most: dict[str, int] = {}
    gate = threading.Event()
    lock = threading.Lock()

    def counted(raw, enc, lim):
        key = raw[:1].decode()
        with lock:
            active[key] = active.get(key, 0) + 1
            most[key] = max(most.get(key, 0), active[key])
        gate.wait(30)
        with lock:
            active[key] -= 1
        return None
    monkeypatch.setattr(body_work, "read_body", counted)
    body_a, body_b = b"A" * 300_000, b"B" * 300_000

    async def scenario():
        a = [asyncio.ensure_future(work.read("A", body_a, None, limits)) for _ in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(body_work.EpisodeBusy, match="polar_max_episode_pending_bytes"):
            await work.read("A", body_a, None, limits)
        b = asyncio.ensure_future(work.read("B", body_b, None, limits))
        for _ in range(200):
            if active.get("B"):
                break
            await asyncio.sleep(0.01)
        assert active.get("B") == 1 and active.get("A") == 1  # B runs beside A's first, not after A's three
        gate.set()
        await asyncio.gather(*a, b)
    asyncio.get_event_loop().run_until_complete(scenario())
    assert most == {"A": 1, "B": 1}
    assert work.pending("A") == 0 and not work._locks  # nothing kept for finished episodes


def test_calls_in_flight_per_episode_are_bounded(proxy):
    addons, tctx = proxy
    tctx.options.update(polar_max_episode_calls=2)
    body = json.dumps(CHAT).encode()
    for _ in range(2):
        assert request(addons, "POST", path("e-many"), body, {"content-type": "application/json"}).response is None
    st, msg = error_of(request(addons, "POST", path("e-many"), body, {"content-type": "application/json"}))
    assert st == 429 and "polar_max_episode_calls" in msg
    assert request(addons, "POST", path("e-other"), body, {"content-type": "application/json"}).response is None


def _random_json(rng: random.Random, depth: int = 0):
    if depth > 7 or rng.random() < 0.3:
        return rng.choice(['a"b', "x\\", '\\"[{', "\\\\", 1, None, "]]}}", "[[[{{", "\\\\\\\""])
    if rng.random() < 0.5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["k", '"[', "\\"]) + str(i): _random_json(rng, depth + 1) for i in range(rng.randint(0, 4))}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, body_shape.CHUNK])
def test_json_depth_matches_the_byte_by_byte_count(monkeypatch, chunk):
    """The vectorized depth equals the control plane's byte-by-byte one, whatever the chunking
    (escaped quotes and backslash runs cut across chunk ends)."""
    monkeypatch.setattr(body_shape, "CHUNK", chunk)
    rng = random.Random(chunk)
    for _ in range(100 if chunk < 8 else 300):
        raw = json.dumps(_random_json(rng)).encode()
        assert body_shape.json_depth(raw) == reference_depth(raw), raw


def test_element_bound_is_an_upper_bound():
    rng = random.Random(7)

    def count(v) -> int:
        if isinstance(v, list):
            return 1 + sum(count(x) for x in v)
        if isinstance(v, dict):
            return 1 + sum(count(x) for x in v.values())
        return 1
    for _ in range(300):
        v = _random_json(rng)
        assert body_shape.element_bound(json.dumps(v).encode()) >= count(v)
    assert body_shape.element_bound(b"[1,2,3]") == 4 and body_shape.element_bound(b"7") == 1
