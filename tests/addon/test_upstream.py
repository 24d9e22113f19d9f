"""upstream.Upstreams: what the proxy knows of each upstream server (dialect, sampling defaults,
logprobs mode) is learned once per upstream, and forgotten per upstream so that a server restarted
with other flags is learned again. The servers' answers are stubbed where the module asks them."""
from __future__ import annotations

import asyncio
import threading

import pytest

import addon.upstream as upstream
from addon.applied_sampling import ModelDefaults
from addon.sampling_discovery import Discovery

A, B = "http://127.0.0.1:8000", "http://127.0.0.1:9000"
QWEN = ModelDefaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}, "test")


@pytest.fixture
def asked(monkeypatch):
    """Every question the module sends a server, by kind, with the answers the stubs give."""
    seen: dict[str, list] = {"dialect": [], "discover": [], "probe": []}
    answers = {"dialect": "sglang", "mode": "processed"}

    def probe_dialect(base):
        seen["dialect"].append(base)
        return answers["dialect"]

    def discover(base, dialect, model, headers):
        seen["discover"].append((base, dialect, headers))
        return Discovery(QWEN)

    def probe_upstream(base, model, timeout, headers):
        seen["probe"].append((base, model, timeout, headers))
        return answers["mode"]

    monkeypatch.setattr(upstream, "probe_dialect", probe_dialect)
    monkeypatch.setattr(upstream, "discover", discover)
    monkeypatch.setattr(upstream, "probe_upstream", probe_upstream)
    return seen, answers


async def _identity(ups: upstream.Upstreams, base: str) -> tuple:
    dialect = await ups.dialect(base)
    defaults, why = await ups.sampling_defaults(base, dialect, {"Authorization": "Bearer k"})
    return dialect, defaults, why, await ups.logprobs_mode(base, "m", {"Authorization": "Bearer k"})


def test_identity_is_learned_once_per_upstream_and_again_after_forget(asked):
    seen, answers = asked
    ups = upstream.Upstreams()
    ups.probe_timeout_s = 7.0

    async def run():
        assert await _identity(ups, A) == ("sglang", QWEN, "", "processed")
        assert await _identity(ups, A) == ("sglang", QWEN, "", "processed")  # cached: nothing asked again
        assert (len(seen["dialect"]), len(seen["discover"]), len(seen["probe"])) == (1, 1, 1)
        assert seen["discover"][0] == (A, "sglang", {"Authorization": "Bearer k"})
        assert seen["probe"][0] == (A, "m", 7.0, {"Authorization": "Bearer k"})
        await _identity(ups, B)
        # the server at A restarts as another: forgetting A asks A again, and only A
        answers["dialect"], answers["mode"] = "vllm", "raw"
        ups.forget(A)
        assert await _identity(ups, A) == ("vllm", QWEN, "", "raw")
        assert await _identity(ups, B) == ("sglang", QWEN, "", "processed")
        assert seen["dialect"] == [A, B, A]
        assert [d[0] for d in seen["discover"]] == [A, B, A]
        assert [p[0] for p in seen["probe"]] == [A, B, A]
        ups.forget_logprobs_mode()  # a weight sync: the modes only
        answers["mode"] = "scaled"
        assert await _identity(ups, B) == ("sglang", QWEN, "", "scaled")
        assert (len(seen["dialect"]), len(seen["discover"]), len(seen["probe"])) == (3, 3, 4)
    asyncio.run(run())


def test_a_path_prefixed_upstream_is_forgotten_whole(asked):
    """Dialects are keyed by scheme://host:port, the rest by the base with its path prefix:
    forget(base) drops both."""
    seen, _ = asked
    ups = upstream.Upstreams()
    prefixed = A + "/sub"

    async def run():
        await ups.dialect(A)
        await ups.sampling_defaults(prefixed, "vllm", {})
        ups.forget(prefixed)
        await ups.dialect(A)
        await ups.sampling_defaults(prefixed, "vllm", {})
    asyncio.run(run())
    assert seen["dialect"] == [A, A] and [d[0] for d in seen["discover"]] == [prefixed, prefixed]


def test_options_answer_without_asking_the_server(asked):
    seen, _ = asked
    ups = upstream.Upstreams()
    ups.dialect_option, ups.logprobs_mode_option, ups.sampling_option = "vllm", "unknown", QWEN
    assert asyncio.run(_identity(ups, A)) == ("vllm", QWEN, "", None)
    ups.logprobs_mode_option = "raw"
    assert asyncio.run(_identity(ups, A))[3] == "raw"
    assert seen == {"dialect": [], "discover": [], "probe": []}


def test_a_discovery_in_flight_when_forgotten_is_not_written_back(monkeypatch):
    """The calls already waiting get the old server's answer; the next call asks the new one."""
    release = threading.Event()
    answers = [Discovery(None, "old server", definite=True), Discovery(QWEN)]
    calls = []

    def discover(base, dialect, model, headers):
        calls.append(base)
        if len(calls) == 1:
            release.wait(10)
        return answers[len(calls) - 1]

    monkeypatch.setattr(upstream, "discover", discover)
    ups = upstream.Upstreams()

    async def run():
        waiting = asyncio.ensure_future(ups.sampling_defaults(A, "vllm", {}))
        while not calls:
            await asyncio.sleep(0.01)
        ups.forget(A)  # the server restarted while it was being asked
        release.set()
        assert await waiting == (None, "old server")
        await asyncio.sleep(0)  # (the done callback runs)
        assert await ups.sampling_defaults(A, "vllm", {}) == (QWEN, "")
    asyncio.run(run())
    assert calls == [A, A]


def test_a_new_connection_relearns_an_identity_older_than_recheck_s(asked):
    """A server restarted between calls fails no call; the proxy's new connection to it makes an
    identity learned more than recheck_s ago be learned again (only that server's)."""
    seen, answers = asked
    ups = upstream.Upstreams()
    ups.recheck_s = 10.0

    async def run():
        assert not ups.connecting("127.0.0.1:8000", 100.0)  # the first connection: nothing to forget
        assert (await _identity(ups, A))[3] == "processed"
        await _identity(ups, B)
        assert not ups.connecting("127.0.0.1:8000", 105.0)  # within recheck_s: kept
        assert await _identity(ups, A) == ("sglang", QWEN, "", "processed")
        answers["mode"] = "raw"  # restarted with another --logprobs-mode
        assert ups.connecting("127.0.0.1:8000", 111.0)
        assert await _identity(ups, A) == ("sglang", QWEN, "", "raw")
        assert [b for b, *_ in seen["probe"]] == [A, B, A]  # B (port 9000) untouched
        assert len(seen["dialect"]) == 3 and len(seen["discover"]) == 3
        assert not ups.connecting("127.0.0.1:8000", 115.0)  # counted from the re-learning
        ups.recheck_s = -1.0  # never
        assert not ups.connecting("127.0.0.1:8000", 1e6)

    asyncio.run(run())
