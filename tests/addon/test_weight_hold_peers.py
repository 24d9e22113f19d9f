"""A proxy's part in a sync another proxy of the same server runs (weight_hold.UpstreamWeights
hold_for_peer / release_peer, the /hold and /release bodies), with a scripted server. Several real
proxies in front of polar-serve: tests/rollout/test_proxies_e2e.py."""
from __future__ import annotations

import asyncio
import json

import pytest

from addon.weight_hold import UpstreamWeights
from polar_contracts.control import ControlRequestError, parse_hold_body, parse_release_body, parse_sync_request
from polar_contracts.weight_versions import UNKNOWN_PREFIX, spanning

from .test_weight_hold import Server, vllm_table


def polar_serve_table(version="0"):
    state = {"v": version, "reloads": 0}

    def reload(body):
        state["v"], state["reloads"] = body["weight_version"], state["reloads"] + 1
        return 200, {"weight_version": state["v"]}

    return state, {("GET", "/polar/weight_version"): lambda _: (200, {"weight_version": state["v"]}),
                   ("POST", "/polar/reload"): reload}


@pytest.mark.parametrize("parse, body, message", [
    (parse_hold_body, b"{}", "missing keys \\['lease_s', 'version'\\]"),
    (parse_hold_body, b'{"version": "1", "lease_s": 0}', "lease_s"),
    (parse_hold_body, b'{"version": "1", "lease_s": true}', "lease_s"),
    (parse_hold_body, b'{"version": "unknown:x", "lease_s": 5}', "not start with"),
    (parse_hold_body, b'{"version": "1", "lease_s": 5, "path": "/m"}', "unknown keys \\['path'\\]"),
    (parse_release_body, b'{"version": "1", "weight_version": "1"}', "missing keys \\['ok'\\]"),
    (parse_release_body, b'{"version": "1", "weight_version": "a b", "ok": true}', "'weight_version' must be"),
    (parse_release_body, b'{"version": "1", "weight_version": 3, "ok": true}', "'weight_version' must be"),
    (parse_release_body, b'{"version": "1", "weight_version": "1", "ok": 1}', "'ok' must be true or false"),
    (parse_sync_request, b'{"path": "/m", "version": "1", "peers_drained": "no"}', "'peers_drained' must be"),
])
def test_hold_and_release_bodies_are_validated(parse, body, message):
    with pytest.raises(ControlRequestError, match=message):
        parse(body)


def test_bodies_ok():
    assert parse_hold_body(b'{"version": "step-2", "lease_s": 30}') == ("step-2", 30.0)
    assert parse_release_body(b'{"version": "2", "weight_version": "unknown:why", "ok": false}') == (
        "2", "unknown:why", False)
    assert parse_release_body(b'{"version": "2", "weight_version": null, "ok": false}') == ("2", None, False)
    assert parse_sync_request(b'{"path": "/m", "version": "1"}') == ("/m", "1", True)
    assert parse_sync_request(b'{"path": "/m", "version": "1", "peers_drained": false}') == ("/m", "1", False)


def test_held_proxy_waits_then_serves_the_version_it_is_released_with(tmp_path):
    state, table = polar_serve_table()
    srv = Server(table)

    async def go():
        peer = UpstreamWeights("http://s:1", "polar-serve", "0", http=srv, logdir=str(tmp_path))
        t = peer.gate.admit()  # a call in flight when the hold comes
        hold = asyncio.ensure_future(peer.hold_for_peer("1", drain_s=5.0, lease_s=60))
        await asyncio.sleep(0.01)
        assert peer.gate.state == "draining" and not hold.done()
        waiter = asyncio.ensure_future(peer.enter(hold_max_s=5.0))  # a new call waits at the gate
        peer.finish(t)
        status, ans = await hold
        assert status == 200 and ans["drained"] and ans["in_flight"] == 0 and peer.gate.state == "loading"
        assert not waiter.done() and peer.info()["held_for_peer"]
        assert (await peer.hold_for_peer("2", 1.0, 60))[0] == 409  # one sync at a time
        assert (await peer.sync("/m", "2", 1.0))[0] == 409
        assert peer.release_peer("2", "2", True)[0] == 409  # not the version it holds for
        status, ans = peer.release_peer("1", "1", True)
        assert status == 200 and ans["weight_version"] == "1" and ans["previous_version"] == "0"
        ticket = await waiter
        return peer, ticket

    peer, ticket = asyncio.run(go())
    assert ticket.version == "1" and peer.gate.state == "serving" and peer.gate.syncs == 1
    assert state["reloads"] == 0 and not [m for m, *_ in srv.seen if m == "POST"]  # a held proxy never loads
    rec = [json.loads(x) for x in (tmp_path / "weight-syncs.jsonl").read_text().splitlines()]
    assert len(rec) == 1 and rec[0]["role"] == "held for a peer's sync" and rec[0]["weight_version"] == "1"
    assert rec[0]["outcome"] == "ok" and rec[0]["drained"] is True


def test_a_call_still_in_flight_after_the_drain_spans_and_the_leader_is_told():
    table = vllm_table("default", lambda p: True)
    table[("POST", "/pause?mode=keep")] = (200, {"status": "paused"})
    table[("POST", "/reset_prefix_cache?reset_running_requests=true")] = (200, {"success": True})
    srv = Server(table)

    async def go():
        peer = UpstreamWeights("http://p:1", "vllm", "default", http=Server({}))
        leader = UpstreamWeights("http://s:1", "vllm", "default", http=srv)
        t = peer.gate.admit()
        status, ans = await peer.hold_for_peer("step-1", drain_s=0.0, lease_s=60)
        assert status == 200 and not ans["drained"] and ans["spanned_calls"] == 1
        sync = await leader.sync("/new", "step-1", 1.0, peers_drained=ans["drained"])
        peer.release_peer("step-1", sync[1]["weight_version"], sync[0] == 200)
        peer.finish(t)
        return t, sync

    t, (status, ans) = asyncio.run(go())
    assert status == 200 and ans["weight_version"] == "step-1"
    assert t.version == spanning("default", "step-1")
    posts = [p for m, p, *_ in srv.seen if m == "POST"]
    # the peer's call was still running: vLLM must keep it and drop the old weights' cached blocks
    assert posts[0] == "/pause?mode=keep" and "/reset_prefix_cache?reset_running_requests=true" in posts


def test_a_hold_nobody_releases_ends_at_its_lease_with_the_servers_version(tmp_path):
    state, table = polar_serve_table()

    async def go():
        peer = UpstreamWeights("http://s:1", "polar-serve", "0", http=Server(table), logdir=str(tmp_path))
        assert (await peer.hold_for_peer("1", 1.0, lease_s=0.05))[0] == 200
        state["v"] = "1"  # the leader's sync loaded, then its coordinator died before the release
        await asyncio.sleep(0.3)
        return peer

    peer = asyncio.run(go())
    assert peer.gate.state == "serving" and peer.gate.version == "1" and not peer.info()["held_for_peer"]
    rec = json.loads((tmp_path / "weight-syncs.jsonl").read_text())
    assert "lease expired" in rec["error"] and rec["weight_version"] == "1"


def test_lease_end_with_an_unreadable_server_names_no_version():
    async def go():
        peer = UpstreamWeights("http://s:1", "polar-serve", "0", http=Server({}))
        await peer.hold_for_peer("1", 1.0, lease_s=0.05)
        await asyncio.sleep(0.3)
        return peer

    peer = asyncio.run(go())
    assert peer.gate.state == "serving" and peer.gate.version.startswith(UNKNOWN_PREFIX)


def test_release_without_a_hold_is_refused():
    async def go():
        return UpstreamWeights("http://s:1", "polar-serve", "0", http=Server({})).release_peer("1", "1", True)

    status, ans = asyncio.run(go())
    assert status == 409 and "no weight hold for version '1'" in ans["error"]
