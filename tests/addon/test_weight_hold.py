"""weight_hold.UpstreamWeights' decisions with a scripted server (the paths a real server cannot be
made to take on demand: a vLLM whose failed reload cannot be undone, a version that does not read
back). The real servers are in test_weight_gate_e2e.py and tests/vllm/test_weight_sync_vllm.py."""
from __future__ import annotations

import asyncio
import json

from addon.weight_hold import PROXY_START, UpstreamWeights
from polar_contracts.weight_versions import UNKNOWN_PREFIX, is_proxy_version, proxy_version


class Server:
    """Answers by (method, path) from a table; a callable value decides per body. Records requests."""

    def __init__(self, table: dict):
        self.table, self.seen = table, []

    async def __call__(self, method, url, body, headers, timeout):
        path = url.split("://", 1)[1].partition("/")[2]
        self.seen.append((method, "/" + path, body, dict(headers)))
        ans = self.table.get((method, "/" + path), (404, {"detail": "Not Found"}))
        if callable(ans):
            ans = ans(body)
        status, obj = ans
        return status, json.dumps(obj).encode()


def vllm_table(version: str, reload_ok) -> dict:
    state = {"v": version}

    def update(body):
        state["v"] = body["new_version"]
        return 200, {"success": True, "new_version": body["new_version"]}

    return {
        ("GET", "/weight_info"): lambda _: (200, {"weight_version": state["v"]}),
        ("GET", "/v1/models"): (200, {"data": [{"id": "m", "root": "/models/orig"}]}),
        ("POST", "/pause?mode=wait"): (200, {"status": "paused"}),
        ("POST", "/resume"): (200, {"status": "resumed"}),
        ("POST", "/update_weight_version"): update,
        ("POST", "/collective_rpc"): lambda b: (200, {"results": [None]}) if reload_ok(b["kwargs"]["weights_path"])
        else (500, {"error": {"message": "Worker failed"}}),
    }


def run(coro):
    return asyncio.run(coro)


def test_detect_order_and_api_key_header():
    srv = Server({("GET", "/model_info"): (200, {"weight_version": "default", "model_path": "/m"})})

    async def go():
        uw = UpstreamWeights("http://s:1", None, None, http=srv, headers={"Authorization": "Bearer k"})
        await uw.detect("auto")
        return uw

    uw = run(go())
    assert uw.kind == "sglang" and uw.gate.version == "default"
    assert [p for _, p, _, _ in srv.seen] == ["/weight_info", "/model_info"]
    assert all(h == {"Authorization": "Bearer k"} for *_, h in srv.seen)


def test_vllm_failed_reload_is_undone_with_the_last_good_weights():
    srv = Server(vllm_table("default", lambda p: p != "/bad"))

    async def go():
        uw = UpstreamWeights("http://s:1", None, None, http=srv)
        await uw.detect("vllm")
        return uw, await uw.sync("/bad", "step-1", 1.0)

    uw, (status, ans) = run(go())
    assert status == 502 and ans["weight_version"] == "default" and ans["recovery"]["outcome"] == "ok"
    posts = [(p, b) for m, p, b, _ in srv.seen if m == "POST"]
    assert posts == [("/pause?mode=wait", None),
                     ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/bad"}}),
                     ("/resume", None),  # always, after a failure
                     ("/pause?mode=wait", None),
                     ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/models/orig"}}),
                     ("/update_weight_version", {"new_version": "default"}), ("/resume", None)]
    assert uw.gate.state == "serving" and uw.gate.version == "default" and uw.gate.syncs == 0


def test_vllm_failed_reload_that_cannot_be_undone_names_no_version():
    srv = Server(vllm_table("default", lambda p: False))

    async def go():
        uw = UpstreamWeights("http://s:1", None, None, http=srv)
        await uw.detect("vllm")
        return uw, await uw.sync("/bad", "step-1", 1.0)

    uw, (status, ans) = run(go())
    assert status == 502 and ans["weight_version"].startswith(UNKNOWN_PREFIX), ans
    assert uw.gate.version == ans["weight_version"] and uw.gate.state == "serving"
    assert [p for m, p, *_ in srv.seen if m == "POST"].count("/resume") == 2


def test_a_version_that_does_not_read_back_fails_the_sync():
    table = vllm_table("default", lambda p: True)
    table[("GET", "/weight_info")] = (200, {"weight_version": "default"})  # ignores the update

    async def go():
        uw = UpstreamWeights("http://s:1", "vllm", "default", http=Server(table))
        return uw, await uw.sync("/new", "step-1", 1.0)

    uw, (status, ans) = run(go())
    assert status == 502 and "reports weight_version 'default' after the sync" in ans["error"]


def test_unknown_server_refuses_syncs():
    async def go():
        uw = UpstreamWeights("http://s:1", None, None, http=Server({}))
        await uw.detect("auto")
        return await uw.sync("/new", "step-1", 1.0)

    status, ans = run(go())
    assert status == 503 and "polar_server_kind" in ans["error"] and "VLLM_SERVER_DEV_MODE=1" in ans["error"]


def test_a_server_that_names_no_version_gets_the_proxys_own():
    """Stock vLLM (no VLLM_SERVER_DEV_MODE): no version route answers. Rows still name a version
    from the first call: the proxy's own (weight_versions.proxy_version), never null; a later
    detection that succeeds (the server came up) takes the server's word; a peer's release that
    names no version keeps a name."""
    srv = Server({("GET", "/v1/models"): (200, {"data": [{"id": "m", "root": "/m", "owned_by": "vllm"}]})})

    async def go():
        uw = UpstreamWeights("http://s:1", None, None, http=srv)
        await uw.detect("auto")
        first = (uw.kind, uw.gate.version, uw.gate.admit().version)
        await uw.hold_for_peer("step-1", 0.1, 60.0)
        uw.release_peer("step-1", None, False, "a peer's sync named nothing")
        released = uw.gate.version
        srv.table[("GET", "/weight_info")] = (200, {"weight_version": "default"})
        uw.detect_retry_at = 0.0
        await uw.detect("auto")
        return first, released, uw.gate.version

    (kind, version, ticket), released, later = run(go())
    assert kind is None and version == ticket and is_proxy_version(version)
    assert version == proxy_version(PROXY_START, 0) and version.endswith("-0")
    assert released == version  # (no successful sync: the count is still 0)
    assert later == "default"
