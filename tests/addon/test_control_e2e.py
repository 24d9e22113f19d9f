"""The agent's view of the proxy, end to end: real mitmdump + the addon with a control secret, in front
of polar-serve (weight syncs, versions) and of the recording upstream of the fault tests (to see what
was forwarded). What an agent in a sandbox can send, since its model calls reach this proxy: forged
and sibling episode ends, weight syncs, holds and releases, the server's own routes behind its
capability, a bare id, a wrong mac, unbounded bodies. Each is refused, logged, never forwarded, and
changes nothing; the node, holding the secret, does all of it."""
from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest

from polar_contracts.control import CONTROL_HEADER, capability, new_secret, write_secret_file
from polar_contracts.log.reader import read_episode, read_log
from tests.faults.conftest import scripted
from tests.faults.helpers import CHAT, whole
from tests.faults.scripted_upstream import answer_header
from tests.support.servers import polar_serve, tiny_model_dir

from .procs import mitmdump
from .test_polar_serve_e2e import SCRIPT


def eid() -> str:
    return "t-" + uuid.uuid4().hex[:10]


def secret_file(work):
    secret = new_secret()
    path = work / "control-secret"
    write_secret_file(path, secret)
    return secret, path


@pytest.fixture(scope="module")
def serve_stack(tmp_path_factory):
    """polar-serve behind a secured proxy."""
    work = tmp_path_factory.mktemp("control-serve")
    secret, sfile = secret_file(work)
    with polar_serve(tiny_model_dir(), "vllm", script=SCRIPT) as srv:
        with mitmdump(work, work / "logs", upstream=srv.base_url,
                      sets={"polar_dialect": "vllm", "polar_control_secret_file": sfile,
                            "polar_server_kind": "polar-serve", "polar_logprobs_mode": "unknown"}) as px:
            model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            yield srv, px, work / "logs", secret, model


@pytest.fixture(scope="module")
def rec_stack(tmp_path_factory):
    """The recording upstream behind a secured proxy (small bounds, to test them cheaply)."""
    work = tmp_path_factory.mktemp("control-rec")
    secret, sfile = secret_file(work)
    with scripted(work) as up, mitmdump(work, work / "logs", upstream=up.url,
                                        sets={"polar_dialect": "vllm", "polar_control_secret_file": sfile,
                                              "polar_logprobs_mode": "unknown", "polar_max_episodes": 8,
                                              "polar_max_body": 1 << 20, "polar_server_api_key": "sk-UPSTREAM-key-77"}) as px:
        yield up, px, work / "logs", secret


def chat(px, name: str, model: str, via: str = "header", extra_headers=None):
    body = {"model": model, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    url = px.url + (f"/polar/{name}" if via == "path" else "") + "/v1/chat/completions"
    h = {"x-polar-episode": name} if via == "header" else {}
    return httpx.post(url, json=body, headers={**h, **(extra_headers or {})}, timeout=60)


def served_version(srv) -> str:
    return httpx.get(srv.base_url + "/polar/weight_version", timeout=10).json()["weight_version"]


def refused(logdir) -> list[dict]:
    p = logdir / "refused.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def recorded(up) -> list[str]:
    return [json.loads(x)["path"] for x in up.record.read_text().splitlines()] if up.record.exists() else []


# -- episode ends ---------------------------------------------------------------------------------
def test_forged_and_sibling_ends_are_refused_and_the_nodes_end_counts(serve_stack):
    srv, px, logdir, secret, model = serve_stack
    me, sibling = eid(), eid()
    for e in (me, sibling):
        assert chat(px, capability(secret, e), model).status_code == 200
    my_cap = capability(secret, me)
    forged = [(f"/polar/{me}/end", {}), (f"/polar/{sibling}/end", {}), (f"/polar/{my_cap}/end", {}),
              (f"/polar/{sibling}/end", {"x-polar-episode": my_cap}),
              (f"/polar/{me}/end", {CONTROL_HEADER: my_cap}), (f"/polar/{me}/end", {CONTROL_HEADER: "x" * 43})]
    for path, headers in forged:
        r = httpx.post(px.url + path, json={"reward": 1.0}, headers=headers, timeout=30)
        assert r.status_code == 403, (path, headers, r.text)
        assert r.json()["error"]["type"] == "polar_refused"
    for e in (me, sibling):
        assert not read_episode(logdir / f"{e}.arrow").finished  # nothing changed
    # the node's end, with the secret: the reward on record is the node's
    for e, reward in ((me, 0.0), (sibling, 0.25)):
        r = httpx.post(px.url + f"/polar/{e}/end", json={"reward": reward}, headers={CONTROL_HEADER: secret})
        assert r.status_code == 200 and r.json()["ended"], r.text
        log = read_episode(logdir / f"{e}.arrow")
        assert log.finished and log.reward == reward
    lines = refused(logdir)
    assert sum(x["path"].endswith("/end") and x["status"] == 403 for x in lines) >= len(forged)
    assert secret not in (logdir / "refused.jsonl").read_text()
    assert my_cap.rpartition("~")[2] not in (logdir / "refused.jsonl").read_text()


# -- weight syncs ---------------------------------------------------------------------------------
def test_weight_endpoints_refuse_the_agent_and_serve_the_node(serve_stack):
    srv, px, logdir, secret, model = serve_stack
    before = served_version(srv)
    cap = capability(secret, eid())
    attempts = [("POST", "/polar/@weights", {"path": str(tiny_model_dir()), "version": "v-agent"}),
                ("POST", "/polar/@weights/hold", {"version": "v-agent", "lease_s": 86400}),
                ("POST", "/polar/@weights/release", {"version": "v-agent", "weight_version": "v-forged", "ok": True}),
                ("GET", "/polar/@weights", None)]
    for method, path, body in attempts:
        for headers in ({}, {"x-polar-episode": cap}, {CONTROL_HEADER: cap}, {"authorization": "Bearer x"}):
            r = httpx.request(method, px.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 403, (path, headers, r.text)
    # nothing changed: the server's version, and no hold (a model call passes at once)
    assert served_version(srv) == before
    t0 = time.monotonic()
    assert chat(px, cap, model).status_code == 200 and time.monotonic() - t0 < 10
    # the node, with the secret: a sync loads, a hold and its release work
    h = {CONTROL_HEADER: secret}
    assert httpx.get(px.url + "/polar/@weights", headers=h).json()["weight_version"] == before
    r = httpx.post(px.url + "/polar/@weights", json={"path": str(tiny_model_dir()), "version": "v-node"}, headers=h,
                   timeout=180)
    assert r.status_code == 200 and r.json()["weight_version"] == "v-node", r.text
    assert served_version(srv) == "v-node"
    r = httpx.post(px.url + "/polar/@weights/hold", json={"version": "v-next", "lease_s": 30}, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["held"]
    r = httpx.post(px.url + "/polar/@weights/release", json={"version": "v-next", "weight_version": "v-node",
                                                             "ok": True}, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["released"]


# -- model calls ----------------------------------------------------------------------------------
def test_model_calls_need_their_capability(serve_stack):
    srv, px, logdir, secret, model = serve_stack
    e = eid()
    other = new_secret()
    for name, via in ((e, "header"), (e, "path"), (capability(other, e), "header"),
                      (e + "~" + capability(secret, e + "x").rpartition("~")[2], "path")):
        r = chat(px, name, model, via)
        assert r.status_code == 403, (name, via, r.text)
    r = httpx.post(px.url + "/v1/chat/completions", json={"model": model, "messages": []}, timeout=30)
    assert r.status_code == 403 and "names no episode" in r.text  # not the default episode
    assert not (logdir / f"{e}.arrow").exists() and not (logdir / "default.arrow").exists()
    for via in ("header", "path"):
        assert chat(px, capability(secret, e), model, via).status_code == 200
    assert read_log(logdir / f"{e}.arrow").height == 2


@pytest.mark.parametrize("path", ["/polar/reload", "/collective_rpc", "/pause", "/sleep", "/tokenize"])
def test_server_routes_behind_a_capability_are_refused_not_forwarded(rec_stack, path):
    up, px, logdir, secret = rec_stack
    cap = capability(secret, eid())
    n = len(recorded(up))
    for url, headers in ((f"{px.url}/polar/{cap}{path}", {}), (px.url + path, {"x-polar-episode": cap}),
                         (px.url + path, {})):
        r = httpx.post(url, json={"model": "m", "weights_path": "/tmp/agent"}, headers=headers, timeout=30)
        assert r.status_code == 403 and "not a model API route" in r.json()["error"]["message"], r.text
    assert recorded(up)[n:] == []  # the upstream saw no request
    mine = [x for x in refused(logdir) if path in x["path"]]
    assert len(mine) >= 3 and all(x["status"] == 403 and x["method"] == "POST" for x in mine)
    assert any(x["episode"] == cap.rpartition("~")[0] for x in mine)


# -- bounds ---------------------------------------------------------------------------------------
def end(px, episode, body, secret):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{px.url}/polar/{episode}/end", content=data, headers={CONTROL_HEADER: secret}, timeout=60)


def ok_call(px, name):
    return httpx.post(px.url + "/v1/chat/completions", json=CHAT, timeout=30,
                      headers={"x-polar-episode": name, "x-answer": answer_header({"body": whole([9707])})})


def test_bad_end_bodies_are_4xx_never_forwarded_and_change_nothing(rec_stack):
    up, px, logdir, secret = rec_stack
    e = eid()
    assert ok_call(px, capability(secret, e)).status_code == 200
    n = len(recorded(up))
    for body, status in ((b'{"reward": 1e308}', 400), (b"[" * 200_000 + b"]" * 200_000, 413),
                         (b'{"metadata": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400),
                         (b'{"reward": 1, "metadata": {"x": "' + b"a" * (100 << 20) + b'"}}', 413)):
        r = end(px, e, body, secret)
        assert r.status_code == status, (body[:40], r.text[:300])
    assert recorded(up)[n:] == []
    assert not read_episode(logdir / f"{e}.arrow").finished
    assert end(px, e, {"reward": 0.5}, secret).status_code == 200


def test_a_model_call_over_polar_max_body_is_413(rec_stack):
    up, px, logdir, secret = rec_stack
    e = eid()
    n = len(recorded(up))
    body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "a" * (2 << 20)}]}).encode()
    r = httpx.post(px.url + "/v1/chat/completions", content=body, timeout=60,
                   headers={"x-polar-episode": capability(secret, e), "content-type": "application/json"})
    assert r.status_code == 413 and "polar_max_body" in r.text
    assert recorded(up)[n:] == [] and not (logdir / f"{e}.arrow").exists()


def test_too_many_open_episodes_503_and_no_new_file(rec_stack):
    up, px, logdir, secret = rec_stack
    names = [eid() for _ in range(12)]
    answers = [ok_call(px, capability(secret, e)).status_code for e in names]
    assert set(answers) == {200, 503} and answers.count(200) <= 8, answers  # polar_max_episodes=8
    for e, st in zip(names, answers, strict=True):
        assert (logdir / f"{e}.arrow").exists() == (st == 200)
    for e, st in zip(names, answers, strict=True):  # ends free the places
        if st == 200:
            assert end(px, e, {"reward": 0}, secret).status_code == 200
    assert ok_call(px, capability(secret, eid())).status_code == 200


def test_upstream_key_scrubbed_from_a_tool_result(rec_stack):
    """The agent ran `env` and its tool result quotes the upstream key, the control secret and its
    harness's key: the logged request and answer hold none of them."""
    up, px, logdir, secret = rec_stack
    e = eid()
    cap = capability(secret, e)
    env = f"POLAR_UPSTREAM=sk-UPSTREAM-key-77 S={secret} OPENAI_API_KEY=sk-harness-key-88 EP={cap}"
    body = {**CHAT, "messages": [{"role": "user", "content": "run env"},
                                 {"role": "tool", "tool_call_id": "c1", "content": env}],
            "client_secret": "cs-SECRET-1", "x-goog-api-key": "goog-SECRET-2", "password": "pw-SECRET-3"}
    r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=30,
                   headers={"x-polar-episode": cap, "authorization": "Bearer sk-harness-key-88",
                            "x-answer": answer_header({"body": whole([9707]).replace("Hi", env)})})
    assert r.status_code == 200
    raw = (logdir / f"{e}.arrow").read_bytes()
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    text = json.dumps({k: v for k, v in row.items() if isinstance(v, str)})
    for s in ("sk-UPSTREAM-key-77", secret, "sk-harness-key-88", cap.rpartition("~")[2], "cs-SECRET-1",
              "goog-SECRET-2", "pw-SECRET-3"):
        assert s not in text and s.encode() not in raw, s
    req = json.loads(row["request"])
    assert req["client_secret"] == req["x-goog-api-key"] == req["password"] == "[redacted]"
    assert "[redacted]" in row["response"]
    # and the forwarded request carried neither the capability nor the control secret upstream
    assert all(cap not in json.dumps(x) for x in recorded(up))


def test_a_planted_symlink_log_is_refused_and_its_target_not_created(rec_stack, tmp_path):
    up, px, logdir, secret = rec_stack
    e = eid()
    target = tmp_path / "not-a-log"
    (logdir / f"{e}.arrow").symlink_to(target)
    r = ok_call(px, capability(secret, e))
    assert r.status_code == 503 and "symbolic link" in r.text
    assert not target.exists()


@pytest.mark.parametrize("sets", [{}, {"connection_strategy": "eager"}], ids=["default", "eager-asked"])
def test_control_plane_answers_with_the_upstream_down(tmp_path, sets):
    """The inference server is down (a closed port): the proxy's own endpoints still answer, since
    polar_lazy_connect reads a request before connecting upstream (mitmproxy's eager default
    closed the connection first: an empty reply). A model call gets mitmproxy's 502 and its row."""
    from harness_recipes.node.processes import free_port

    secret, sfile = secret_file(tmp_path)
    with mitmdump(tmp_path, tmp_path / "logs", upstream=f"http://127.0.0.1:{free_port()}",
                  sets={"polar_dialect": "vllm", "polar_control_secret_file": sfile,
                        "polar_logprobs_mode": "unknown", **sets}) as px:
        ctl = {CONTROL_HEADER: secret}
        r = httpx.get(px.url + "/polar/@control", headers=ctl, timeout=10)
        assert r.status_code == 200 and r.json() == {"control": "secured"}
        e = eid()
        cap = capability(secret, e)
        r = httpx.post(px.url + f"/polar/{cap}/v1/chat/completions", json={"model": "m", "messages": []}, timeout=10)
        assert r.status_code == 502
        r = httpx.post(px.url + f"/polar/{e}/end", json={"reward": 1.0}, headers=ctl, timeout=10)
        assert r.status_code == 200 and r.json()["ended"] is True and r.json()["calls"] == 1
        rows = read_log(tmp_path / "logs" / f"{e}.arrow")
        assert "connection failed before a response" in rows.row(0, named=True)["error"]
