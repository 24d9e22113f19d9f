"""harness_recipes/node/proxies.py without processes: the episode -> proxy hash, and one weight sync across
several proxies (sync_proxies) driving the addon's own gates (weight_hold.UpstreamWeights) in this
process in front of a scripted server. Real mitmdumps in front of polar-serve: test_proxies_e2e.py."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter

import pytest

from addon.weight_hold import UpstreamWeights
from harness_recipes.node.episode import Settings
from harness_recipes.node.proxies import pick, sync_proxies
from polar_contracts.control import HOLD_PATH, RELEASE_PATH, SYNC_PATH, parse_hold_body, parse_release_body, parse_sync_request
from polar_contracts.weight_versions import UNKNOWN_PREFIX


def test_pick_is_stable_across_processes_and_spreads_episodes():
    ids = [f"task{i}-s0-a0" for i in range(2000)]
    here = [pick(e, 3) for e in ids[:50]]
    code = "import sys; from harness_recipes.node.proxies import pick; print([pick(f'task{i}-s0-a0', 3) for i in range(50)])"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", **__import__("os").environ}).stdout
    assert json.loads(other) == here
    counts = Counter(pick(e, 3) for e in ids)
    assert set(counts) == {0, 1, 2} and min(counts.values()) > 550  # ~667 each
    assert all(pick(e, 1) == 0 for e in ids[:20])
    with pytest.raises(ValueError, match="at least one proxy"):
        pick("x", 0)


def test_settings_send_each_episode_to_one_proxy():
    s = Settings(proxy="http://unused", proxies=("http://a", "http://b"))
    assert {s.proxy_for(f"e{i}") for i in range(40)} == {"http://a", "http://b"}
    assert all(s.proxy_for("e7") == s.proxy_for("e7") for _ in range(5))
    assert Settings(proxy="http://one").proxy_for("e7") == "http://one"


class Stack:
    """N in-process proxies (the addon's UpstreamWeights, dispatched as polar_addon does) in front
    of one scripted polar-serve; ``events`` is the order the proxies saw the sync's requests."""

    def __init__(self, n: int, reload_ok=lambda path: True):
        self.version, self.reloads, self.events = "0", 0, []
        self.proxies = {f"http://p{i}": UpstreamWeights("http://s:1", "polar-serve", "0", http=self.server)
                        for i in range(n)}
        self.reload_ok = reload_ok
        self.unreachable: set[str] = set()
        self.bodies: list[dict] = []

    async def server(self, method, url, body, headers, timeout):
        if method == "GET":
            return 200, json.dumps({"weight_version": self.version}).encode()
        await asyncio.sleep(0.01)
        if not self.reload_ok(body["model"]):
            return 500, b'{"error": "no such model"}'
        self.reloads += 1
        self.version = body["weight_version"]
        return 200, json.dumps({"weight_version": self.version}).encode()

    async def __call__(self, method, url, body, headers, timeout):
        base, path = url[:9], url[9:]
        if base in self.unreachable:
            raise ConnectionRefusedError(f"{base} is down")
        uw, raw = self.proxies[base], json.dumps(body).encode()
        self.events.append((base, path))
        self.bodies.append(body)
        if path == HOLD_PATH:
            version, lease = parse_hold_body(raw)
            status, ans = await uw.hold_for_peer(version, 1.0, lease)
        elif path == RELEASE_PATH:
            status, ans = uw.release_peer(*parse_release_body(raw))
        else:
            assert path == SYNC_PATH
            p, version, peers_drained = parse_sync_request(raw)
            status, ans = await uw.sync(p, version, 1.0, peers_drained)
        return status, json.dumps(ans).encode()

    @property
    def states(self):
        return {(uw.gate.state, uw.gate.version) for uw in self.proxies.values()}


def test_sync_holds_all_then_loads_once_then_releases_all():
    st = Stack(3)

    async def go():
        p2 = st.proxies["http://p2"]
        t = p2.gate.admit()  # a call in flight at a held proxy: the load waits for it
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, p2.finish, t)
        res = await sync_proxies(list(st.proxies), "/w/1", "1", http=st)
        return t, res

    t, res = asyncio.run(go())
    assert res.ok and res.weight_version == "1" and res.error is None, res
    assert st.reloads == 1 and st.states == {("serving", "1")}
    assert t.version == "0"  # drained before the load: not spanning
    assert st.bodies[2] == {"path": "/w/1", "version": "1", "peers_drained": True}
    kinds = [path for _, path in st.events]
    assert kinds == [HOLD_PATH, HOLD_PATH, SYNC_PATH, RELEASE_PATH, RELEASE_PATH]
    assert [b for b, p in st.events if p == SYNC_PATH] == ["http://p0"]


def test_a_proxy_that_cannot_be_held_stops_the_sync_before_any_load():
    st = Stack(3)

    async def go():
        await st.proxies["http://p2"].hold_for_peer("other", 1.0, 60)  # another sync holds p2
        return await sync_proxies(list(st.proxies), "/w/1", "1", http=st)

    res = asyncio.run(go())
    assert res.status == 409 and "http://p2 could not be held" in res.error
    assert st.reloads == 0 and SYNC_PATH not in [p for _, p in st.events]
    p0, p1 = st.proxies["http://p0"], st.proxies["http://p1"]
    assert (p0.gate.state, p1.gate.state) == ("serving", "serving") and p1.gate.version == "0"
    assert [r["status"] for r in res.releases] == [200]


def test_a_failed_load_releases_everyone_on_the_old_version():
    st = Stack(2, reload_ok=lambda path: path != "/w/bad")
    res = asyncio.run(sync_proxies(list(st.proxies), "/w/bad", "1", http=st))
    assert res.status == 502 and res.weight_version == "0" and "failed" in res.error
    assert st.states == {("serving", "0")} and all(uw.gate.syncs == 0 for uw in st.proxies.values())


def test_a_leader_with_no_answer_leaves_the_held_proxies_on_an_unknown_version():
    st = Stack(2)
    st.unreachable.add("http://p0")
    res = asyncio.run(sync_proxies(list(st.proxies), "/w/1", "1", http=st))
    assert not res.ok and res.weight_version.startswith(UNKNOWN_PREFIX)
    p1 = st.proxies["http://p1"]
    assert p1.gate.state == "serving" and p1.gate.version.startswith(UNKNOWN_PREFIX)


def test_one_proxy_is_a_plain_sync():
    st = Stack(1)
    res = asyncio.run(sync_proxies(list(st.proxies), "/w/1", "1", http=st))
    assert res.ok and st.events == [("http://p0", SYNC_PATH)] and st.reloads == 1
