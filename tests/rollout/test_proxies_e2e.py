"""Two real capture proxies (mitmdump + addon, harness_recipes/node/proxies.py) in front of one real
polar-serve, one shared log directory: many concurrent streaming episodes, each sent to its proxy by
its id, end with complete logs holding only their own calls; a weight sync through the pool holds
both proxies, the server loads once, and every row names the version that served it. The pool has
a control secret: calls name their episode by capability, ends and syncs carry the secret.

POLAR_PROXIES_E2E_EPISODES sets the number of concurrent episodes (default 64; the issue's 512 runs
in the benchmark bench/bench_proxies.py)."""
from __future__ import annotations

import asyncio
import json
import os
import uuid

import httpx
import pytest

from harness_recipes.demo.weights import perturbed_copy
from harness_recipes.node.proxies import pick, proxy_pool
from polar_contracts.control import capability
from polar_contracts.log.reader import read_episode
from tests.support.servers import polar_serve, tiny_model_dir

EPISODES = int(os.environ.get("POLAR_PROXIES_E2E_EPISODES", "64"))
CALLS = 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("proxies")
    with polar_serve(tiny_model_dir(), "vllm") as srv, \
            proxy_pool(srv.base_url, work / "logs", k=2, workdir=work / "proxies",
                       sets={"polar_dialect": "vllm"}) as pool:
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        yield srv, pool, work, model


def body(model, eid, i, max_tokens=4, **kw):
    # the episode id in the prompt: a row in another episode's log would show it
    return {"model": model, "max_tokens": max_tokens, "temperature": 1.0, "stream": True,
            "messages": [{"role": "user", "content": f"episode {eid} call {i}: say hi"}], **kw}


async def stream(client: httpx.AsyncClient, pool, eid: str, payload: dict) -> tuple[int, bytes]:
    url, cap = pool.for_episode(eid), capability(pool.secret, eid)
    async with client.stream("POST", f"{url}/polar/{cap}/v1/chat/completions", json=payload) as r:
        return r.status_code, b"".join([c async for c in r.aiter_raw()])


def info(pool, url: str) -> dict:
    return httpx.get(url + "/polar/@weights", headers=pool.control_headers).json()


async def episode(client, pool, model, eid) -> list[str]:
    """CALLS streamed calls then the end, all to the episode's proxy; the problems seen."""
    url, problems = pool.for_episode(eid), []
    for i in range(CALLS):
        status, data = await stream(client, pool, eid, body(model, eid, i))
        if status != 200 or not data.rstrip().endswith(b"data: [DONE]") or b'"error"' in data:
            problems.append(f"{eid} call {i}: HTTP {status} {data[-200:]!r}")
    r = await client.post(f"{url}/polar/{eid}/end", json={"reward": 1.0}, headers=pool.control_headers)
    if r.status_code != 200 or not r.json().get("ended"):
        problems.append(f"{eid} end: HTTP {r.status_code} {r.text[:200]}")
    return problems


def test_concurrent_streaming_episodes_each_log_has_one_writer(stack):
    srv, pool, work, model = stack
    run = uuid.uuid4().hex[:6]
    eids = [f"px-{run}-{i}" for i in range(EPISODES)]
    assert {pick(e, 2) for e in eids} == {0, 1}  # both proxies take episodes

    async def go():
        limits = httpx.Limits(max_connections=EPISODES + 8, max_keepalive_connections=EPISODES + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:
            return await asyncio.gather(*(episode(client, pool, model, e) for e in eids))

    problems = [p for ps in asyncio.run(go()) for p in ps]
    assert problems == [], problems[:5]
    mixed = []
    for e in eids:
        log = read_episode(work / "logs" / f"{e}.arrow")
        rows = log.calls.to_dicts()
        assert log.finished and not log.truncated and log.reward == 1.0
        assert sorted(r["call_index"] for r in rows) == list(range(CALLS)), (e, [r["call_index"] for r in rows])
        assert all(r["error"] is None for r in rows), [r["error"] for r in rows]
        mixed += [(e, r["call_index"]) for r in rows
                  if r["episode_id"] != e or f"episode {e} call {r['call_index']}:" not in r["request"]]
    assert mixed == []


def test_a_sync_through_the_pool_holds_both_and_loads_once(stack):
    srv, pool, work, model = stack
    new = perturbed_copy(tiny_model_dir(), work / "step-1", scale=0.2)
    run = uuid.uuid4().hex[:6]
    # one episode on each proxy
    eids = {}
    i = 0
    while len(eids) < 2:
        e = f"ws-{run}-{i}"
        eids.setdefault(pick(e, 2), e)
        i += 1
    assert pool.secret and pool.secret_file.stat().st_mode & 0o777 == 0o600
    before = [info(pool, u) for u in pool.urls]
    assert len({b["weight_version"] for b in before}) == 1 and {b["state"] for b in before} == {"serving"}
    old = before[0]["weight_version"]
    syncs_before = _syncs(work)

    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            # a long stream on each proxy is in flight when the sync starts
            long = [asyncio.create_task(stream(client, pool, e, body(model, e, 0, max_tokens=120, ignore_eos=True)))
                    for e in eids.values()]
            await _until(lambda: all(info(pool, u)["in_flight"] for u in pool.urls))
            sync = asyncio.create_task(pool.sync(str(new), "1"))
            # new calls on both proxies arrive while the sync holds them
            await _until(lambda: all(info(pool, u)["state"] != "serving" for u in pool.urls))
            held = [asyncio.create_task(stream(client, pool, e, body(model, e, 1))) for e in eids.values()]
            res = await sync
            answers = await asyncio.gather(*long, *held)
            return res, answers

    res, answers = asyncio.run(go())
    assert res.ok and res.weight_version == "1", res
    assert all(s == 200 and d.rstrip().endswith(b"data: [DONE]") for s, d in answers)
    after = [info(pool, u) for u in pool.urls]
    assert [(a["weight_version"], a["state"], a["syncs"]) for a in after] == [("1", "serving", 1)] * 2
    new_recs = _syncs(work)[len(syncs_before):]
    # one record per proxy: the leader's (which loaded, once) and the held one's
    assert sorted(r.get("role", "leader") for r in new_recs) == ["held for a peer's sync", "leader"]
    leader = next(r for r in new_recs if "role" not in r)
    assert [s["step"] for s in leader["steps"]] == ["reload"] and leader["outcome"] == "ok"
    assert httpx.get(srv.base_url + "/polar/weight_version").json()["weight_version"] == "1"
    for e in eids.values():
        rows = sorted(read_episode(work / "logs" / f"{e}.arrow").calls.to_dicts(), key=lambda r: r["call_index"])
        # the long call drained under the old weights; the held one ran on the new
        assert [r["weight_version"] for r in rows] == [old, "1"], (e, [r["weight_version"] for r in rows])
        assert rows[1]["t_first_byte"] >= leader["t_released"] - 0.5


async def _until(pred, timeout=60.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await asyncio.to_thread(pred):
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _syncs(work):
    p = work / "logs" / "weight-syncs.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_hold_and_release_endpoints_refuse_bad_requests(stack):
    srv, pool, work, model = stack
    url, h = pool.urls[1], pool.control_headers
    r = httpx.get(url + "/polar/@weights/hold", headers=h)
    assert r.status_code == 405 and "accepts POST" in r.json()["error"]["message"]
    r = httpx.post(url + "/polar/@weights/hold", json={"version": "9", "lease_s": -1}, headers=h)
    assert r.status_code == 400 and "lease_s" in r.json()["error"]["message"]
    r = httpx.post(url + "/polar/@weights/release", json={"version": "9", "weight_version": "9", "ok": True},
                   headers=h)
    assert r.status_code == 409 and "no weight hold for version '9'" in r.json()["error"]["message"]
    # without the secret: refused before any of that
    r = httpx.post(url + "/polar/@weights/hold", json={"version": "9", "lease_s": 86400})
    assert r.status_code == 403 and "x-polar-control" in r.json()["error"]["message"]
    assert info(pool, url)["state"] == "serving"  # nothing was held
