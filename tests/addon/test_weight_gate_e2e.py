"""Weight syncs through a real mitmdump (the capture addon) in front of a real polar-serve, both
dialects: the vllm dialect is synced by polar-serve's ``/polar/reload``, the sglang dialect by
SGLang 0.5.23's ``/update_weights_from_disk`` (what the proxy detects from each server's version
endpoint). Streaming calls are in flight when the sync starts and new calls arrive while it holds:
the harness sees only a delay, every row names the exact version, the in-flight calls drain under
the old one and the held calls run under the new one; a failing sync releases the calls and does
not advance the version; with no drain time the in-flight call's row says it spans two versions;
the trainer's ``proxy`` sync mode drives the same endpoint."""
from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from harness_recipes.demo.weights import perturbed_copy
from polar_contracts.log.reader import read_log
from polar_contracts.weight_versions import spanning
from tests.support.servers import polar_serve, tiny_model_dir

from .procs import mitmdump

KIND = {"vllm": "polar-serve", "sglang": "sglang"}


@pytest.fixture(scope="module", params=list(KIND))
def stack(request, tmp_path_factory):
    dialect = request.param
    work = tmp_path_factory.mktemp(f"wsync-{dialect}")
    new = perturbed_copy(tiny_model_dir(), work / "step-1", scale=0.2)
    with polar_serve(tiny_model_dir(), dialect) as srv:
        with mitmdump(work, work / "logs", upstream=srv.base_url, sets={"polar_dialect": dialect}) as px:
            model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            yield dialect, srv, px, work, new, model


def chat(model, max_tokens, **kw):
    return {"model": model, "max_tokens": max_tokens, "temperature": 1.0, "seed": 7,
            "messages": [{"role": "user", "content": "Count to one hundred, slowly."}], **kw}


def stream_call(url, body, episode, started: threading.Event | None, out: list):
    """A streamed call; ``started`` is set at its first bytes; appends (status, body bytes)."""
    with httpx.Client(timeout=300) as c:
        with c.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      headers={"x-polar-episode": episode}) as r:
            data = b""
            for chunk in r.iter_raw():
                data += chunk
                if started is not None:
                    started.set()
            out.append((r.status_code, data))


def plain_call(url, body, episode):
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-polar-episode": episode}, timeout=300)
    assert r.status_code == 200, r.text[:300]
    return r.json()


def syncs(work):
    return [json.loads(line) for line in (work / "logs" / "weight-syncs.jsonl").read_text().splitlines()]


def test_sync_while_calls_stream_and_arrive(stack):
    dialect, srv, px, work, new, model = stack
    info = httpx.get(px.url + "/polar/@weights").json()
    assert info["server_kind"] == KIND[dialect] and info["weight_version"] == "default" and info["state"] == "serving"
    e = "ws-" + uuid.uuid4().hex[:8]
    greedy = chat(model, 8, temperature=0, logprobs=True, top_logprobs=1)
    plain_call(px.url, greedy, e)  # call 0, before: "default"
    long = chat(model, 200, ignore_eos=True)
    inflight, started = [], [threading.Event() for _ in range(3)]
    threads = [threading.Thread(target=stream_call, args=(px.url, long, e, s, inflight)) for s in started]
    for t in threads:
        t.start()
    assert all(s.wait(60) for s in started)  # calls 1-3 are streaming
    answer = {}

    def sync():
        r = httpx.post(px.url + "/polar/@weights", json={"path": str(new), "version": "step-1"}, timeout=300)
        answer.update(status=r.status_code, body=r.json())

    ts = threading.Thread(target=sync)
    ts.start()
    deadline = time.time() + 30
    while httpx.get(px.url + "/polar/@weights").json()["state"] == "serving":
        assert time.time() < deadline, "the sync never started holding"
        time.sleep(0.005)
    held = []
    hthreads = [threading.Thread(target=stream_call, args=(px.url, chat(model, 5), e, None, held)) for _ in range(3)]
    for t in hthreads:
        t.start()
    for t in (*threads, ts, *hthreads):
        t.join(300)
    assert answer["status"] == 200, answer
    b = answer["body"]
    assert b["weight_version"] == "step-1" and b["previous_version"] == "default" and b["server_kind"] == KIND[dialect]
    assert b["drained"] is True and b["spanned_calls"] == 0 and b["held_calls"] == 3, b
    # the harness saw complete, ordinary streams (only later)
    for status, data in inflight + held:
        assert status == 200 and data.rstrip().endswith(b"data: [DONE]"), data[-200:]
    plain_call(px.url, greedy, e)  # call 7, after: "step-1"
    df = read_log(work / "logs" / f"{e}.arrow")
    assert df.height == 8 and df["error"].to_list() == [None] * 8, df["error"].to_list()
    rows = df.sort("call_index").to_dicts()
    rec = syncs(work)[-1]
    assert rec["outcome"] == "ok" and rec["target_version"] == "step-1" and rec["held_calls"] == 3
    before = [r for r in rows if r["t_start"] < rec["t_request"]]
    during = [r for r in rows if rec["t_request"] <= r["t_start"] < rec["t_released"]]
    assert len(before) == 4 and len(during) == 3
    assert {r["weight_version"] for r in before} == {"default"}  # drained under the old weights
    assert all(r["t_end"] <= rec["t_loaded"] for r in before)
    assert {r["weight_version"] for r in during} == {"step-1"}  # held, then served by the new weights
    assert all(r["t_first_byte"] >= rec["t_released"] for r in during)
    assert rows[-1]["weight_version"] == "step-1"
    # the new weights serve: the same greedy call's logprobs changed
    assert rows[0]["completion_logprobs"] != rows[-1]["completion_logprobs"]
    assert httpx.get(px.url + "/polar/@weights").json()["weight_version"] == "step-1"


def test_failing_sync_releases_and_keeps_the_version(stack):
    dialect, srv, px, work, new, model = stack
    e = "wf-" + uuid.uuid4().hex[:8]
    before = httpx.get(px.url + "/polar/@weights").json()["weight_version"]
    n = len(syncs(work))
    r = httpx.post(px.url + "/polar/@weights", json={"path": str(work / "no-such-dir"), "version": "step-9"},
                   timeout=300)
    assert r.status_code == 502, r.text
    body = r.json()
    assert "step-9" in body["error"]["message"] and body["weight_version"] == before
    assert ("update_weights_from_disk" if dialect == "sglang" else "/polar/reload") in body["error"]["message"]
    info = httpx.get(px.url + "/polar/@weights").json()
    assert info["state"] == "serving" and info["weight_version"] == before
    plain_call(px.url, chat(model, 3), e)
    assert read_log(work / "logs" / f"{e}.arrow")["weight_version"].to_list() == [before]
    rec = syncs(work)[n:]
    assert len(rec) == 1 and rec[0]["outcome"] == "failed" and rec[0]["weight_version"] == before
    assert rec[0]["error"] and rec[0]["target_version"] == "step-9"
    # a bad request body is refused before anything is held
    r = httpx.post(px.url + "/polar/@weights", json={"path": str(new), "version": "step 2"})
    assert r.status_code == 400 and "must be a string matching" in r.json()["error"]["message"]
    assert len(syncs(work)) == n + 1


def test_no_drain_time_marks_spanning_calls(stack):
    dialect, srv, px, work, new, model = stack
    logs = work / "logs-span"
    with mitmdump(work, logs, upstream=srv.base_url,
                  sets={"polar_dialect": dialect, "polar_sync_drain_ms": "0"}) as px2:
        old = httpx.get(px2.url + "/polar/@weights").json()["weight_version"]
        e = "wsp-" + uuid.uuid4().hex[:8]
        out, started = [], threading.Event()
        t = threading.Thread(target=stream_call, args=(px2.url, chat(model, 200, ignore_eos=True), e, started, out))
        t.start()
        assert started.wait(60)
        r = httpx.post(px2.url + "/polar/@weights", json={"path": str(tiny_model_dir()), "version": "step-2"},
                       timeout=300)
        t.join(300)
        assert r.status_code == 200 and r.json()["spanned_calls"] == 1 and r.json()["drained"] is False, r.text
        assert out[0][0] == 200
        row = read_log(logs / f"{e}.arrow").to_dicts()[0]
        assert row["weight_version"] == spanning(old, "step-2") and row["error"] is None
        assert any("in flight while the proxy had the server load" in n for n in row["notes"])


def test_trainer_proxy_sync_mode(stack, tmp_path):
    """WeightSyncCallback(mode="proxy") learns the initial version, saves the policy, has the proxy
    load it, and hands each version to the ShardSource's sync history."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.shard_source import ShardSource
    from trainer.weight_sync import WeightSyncCallback

    dialect, srv, px, work, new, model = stack
    start = httpx.get(px.url + "/polar/@weights").json()["weight_version"]
    src = ShardSource(str(tmp_path / "shards"), max_policy_lag=1)
    cb = WeightSyncCallback(px.url, save_dir=tmp_path / "w", mode="proxy", source=src, keep=1)
    assert cb.initial_version() == start
    src.set_current_version(cb.initial_version())
    m = AutoModelForCausalLM.from_pretrained(str(new))
    tok = AutoTokenizer.from_pretrained(str(new))
    assert cb.sync(m, tok, 3) == "step-000003"
    assert src.current_version_name == "step-000003" and src.current_version == 1
    assert src.versions.lag(start) == (1, "") and src.versions.lag("step-000003") == (0, "")
    info = httpx.get(px.url + "/polar/@weights").json()
    assert info["weight_version"] == "step-000003"
    served = httpx.get(srv.base_url + ("/model_info" if dialect == "sglang" else "/polar/weight_version")).json()
    assert served["weight_version"] == "step-000003"


def test_hold_timeout_answers_503_and_a_second_sync_409(stack):
    """A call held longer than polar_sync_hold_max_ms gets a 503 naming the sync, is never sent to the
    server, and its row records it; a sync asked for while one runs is refused with 409."""
    dialect, srv, px, work, new, model = stack
    logs = work / "logs-hold"
    with mitmdump(work, logs, upstream=srv.base_url,
                  sets={"polar_dialect": dialect, "polar_sync_hold_max_ms": "1"}) as px3:
        e = "wh-" + uuid.uuid4().hex[:8]
        plain_call(px3.url, chat(model, 2), e)
        answer = {}
        ts = threading.Thread(target=lambda: answer.update(r=httpx.post(
            px3.url + "/polar/@weights", json={"path": str(new), "version": "step-3"}, timeout=300)))
        ts.start()
        while httpx.get(px3.url + "/polar/@weights").json()["state"] == "serving":
            time.sleep(0.002)
        second = httpx.post(px3.url + "/polar/@weights", json={"path": str(new), "version": "step-4"}, timeout=300)
        r = httpx.post(px3.url + "/v1/chat/completions", json=chat(model, 2), headers={"x-polar-episode": e},
                       timeout=300)
        ts.join(300)
        assert second.status_code == 409 and "already running" in second.json()["error"]["message"]
        assert r.status_code == 503 and "step-3" in r.json()["error"]["message"], r.text
        assert answer["r"].status_code == 200 and answer["r"].json()["weight_version"] == "step-3"
        rows = read_log(logs / f"{e}.arrow").sort("call_index").to_dicts()
        assert len(rows) == 2 and rows[1]["status"] == 503 and rows[1]["completion_ids"] is None
        assert "polar_sync_hold_max_ms" in rows[1]["error"] and "step-3" in rows[1]["error"]
        recs = [json.loads(x) for x in (logs / "weight-syncs.jsonl").read_text().splitlines()]
        assert [x["target_version"] for x in recs] == ["step-3"]  # the refused one never started
