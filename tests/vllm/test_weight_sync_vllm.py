"""A full-weight sync through the capture proxy to REAL vLLM 0.32 (CPU build, VLLM_SERVER_DEV_MODE=1):
the proxy learns the served version from ``GET /weight_info``, and ``POST /polar/@weights`` has vLLM
pause, reload the weights from disk in place (``/collective_rpc reload_weights``, the path that runs
on the CPU build), take the new version and resume. The served logprobs change (perturbed weights),
the rows carry the versions exactly, a call in flight drains under the old version and a call
arriving during the sync is held and runs under the new one; a failing sync releases the calls,
never names the target version, and loads the last good weights again (vLLM's failed in-place
reload leaves none: its next forward pass would kill the engine). The original tiny weights and
version are loaded back at the end (the session's vLLM serves every other test).
``POLAR_TEST_VLLM_URL`` points it at a running vLLM."""
from __future__ import annotations

import json
import os
import threading
import time
import uuid

import httpx
import pytest

from harness_recipes.demo.weights import perturbed_copy
from polar_contracts.log.reader import read_log
from tests.addon.procs import mitmdump
from tests.support.servers import tiny_model_dir


@pytest.fixture(scope="module")
def vllm_url(request):
    return os.environ.get("POLAR_TEST_VLLM_URL") or request.getfixturevalue("real_vllm").url


def restore(url: str, version: str) -> None:
    """The original weights and version, directly (whatever state the proxy left)."""
    with httpx.Client(base_url=url, timeout=300) as c:
        assert c.post("/pause?mode=wait").status_code == 200
        try:
            r = c.post("/collective_rpc", json={"method": "reload_weights",
                                                "kwargs": {"weights_path": str(tiny_model_dir())}})
            assert r.status_code == 200, r.text
            assert c.post("/update_weight_version", json={"new_version": version}).status_code == 200
        finally:
            c.post("/resume")


def greedy(model: str) -> dict:
    return {"model": model, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "messages": [{"role": "user", "content": "Say hello."}]}


def post(url, body, episode, out=None, started=None):
    with httpx.Client(timeout=300) as c:
        with c.stream("POST", url + "/v1/chat/completions", json=body, headers={"x-polar-episode": episode}) as r:
            data = b""
            for chunk in r.iter_raw():
                data += chunk
                if started is not None:
                    started.set()
    if out is not None:
        out.append((r.status_code, data))
    return r.status_code, data


def test_full_weight_sync_through_the_proxy(vllm_url, tmp_path):
    dev = httpx.get(vllm_url + "/weight_info")
    if dev.status_code == 404:
        pytest.fail("this vLLM runs without VLLM_SERVER_DEV_MODE=1 (tests/conftest.py VLLM_ENV sets it)")
    original = dev.json()["weight_version"]
    model = httpx.get(vllm_url + "/v1/models").json()["data"][0]["id"]
    new = perturbed_copy(tiny_model_dir(), tmp_path / "step-1", scale=0.2)
    logs = tmp_path / "logs"
    try:
        with mitmdump(tmp_path, logs, upstream=vllm_url, sets={"polar_dialect": "vllm"}) as px:
            info = httpx.get(px.url + "/polar/@weights").json()
            assert info["server_kind"] == "vllm" and info["weight_version"] == original, info
            e = "wsv-" + uuid.uuid4().hex[:8]
            assert post(px.url, greedy(model), e)[0] == 200  # call 0: the original weights
            # call 1 streams while the sync starts; call 2 arrives while it holds
            out, started = [], threading.Event()
            long = {"model": model, "max_tokens": 60, "temperature": 1.0, "top_p": 1.0, "stream": True,
                    "ignore_eos": True, "messages": [{"role": "user", "content": "Count."}]}
            t1 = threading.Thread(target=post, args=(px.url, long, e, out, started))
            t1.start()
            assert started.wait(120)
            answer = {}
            ts = threading.Thread(target=lambda: answer.update(r=httpx.post(
                px.url + "/polar/@weights", json={"path": str(new), "version": "step-1"}, timeout=300)))
            ts.start()
            deadline = time.time() + 60
            while httpx.get(px.url + "/polar/@weights").json()["state"] == "serving":
                assert time.time() < deadline
                time.sleep(0.005)
            t2 = threading.Thread(target=post, args=(px.url, {**greedy(model), "max_tokens": 3}, e, out))
            t2.start()
            for t in (t1, ts, t2):
                t.join(300)
            r = answer["r"]
            assert r.status_code == 200, r.text
            b = r.json()
            assert b["weight_version"] == "step-1" and b["previous_version"] == original and b["server_kind"] == "vllm"
            assert b["drained"] is True and b["held_calls"] == 1 and b["spanned_calls"] == 0, b
            assert httpx.get(vllm_url + "/weight_info").json() == {"weight_version": "step-1"}
            assert httpx.get(vllm_url + "/is_paused").json() == {"is_paused": False}
            assert all(s == 200 for s, _ in out)
            assert post(px.url, greedy(model), e)[0] == 200  # call 3: the new weights
            rows = read_log(logs / f"{e}.arrow").sort("call_index").to_dicts()
            assert [r["error"] for r in rows] == [None] * 4
            rec = json.loads((logs / "weight-syncs.jsonl").read_text().splitlines()[-1])
            assert [s["step"] for s in rec["steps"]] == ["pause", "reload_weights", "update_weight_version", "resume"]
            by_start = sorted(rows, key=lambda r: r["t_start"])
            assert [r["weight_version"] for r in by_start] == [original, original, "step-1", "step-1"]
            held = by_start[2]
            assert rec["t_request"] <= held["t_start"] and held["t_first_byte"] >= rec["t_released"]
            assert by_start[1]["t_end"] <= rec["t_loaded"]  # the in-flight call drained first
            assert rows[0]["completion_logprobs"] != rows[3]["completion_logprobs"]  # perturbed weights serve

            # a sync that fails on the server: released, never named the target
            r = httpx.post(px.url + "/polar/@weights", json={"path": str(tmp_path / "nope"), "version": "step-2"},
                           timeout=300)
            assert r.status_code == 502 and "step-2" in r.text and "collective_rpc" in r.text, r.text
            # vLLM reloads in place: a failed load leaves the weights unloaded (the next forward pass
            # would kill the engine), so the proxy loads the last good weights again and keeps their name
            assert r.json()["weight_version"] == "step-1" and r.json()["recovery"]["outcome"] == "ok", r.text
            assert r.json()["recovery"]["path"] == str(new)
            assert httpx.get(vllm_url + "/is_paused").json() == {"is_paused": False}  # resumed
            assert httpx.get(vllm_url + "/weight_info").json() == {"weight_version": "step-1"}
            assert post(px.url, greedy(model), e)[0] == 200  # the server still serves, the step-1 weights
            last = read_log(logs / f"{e}.arrow").sort("call_index").to_dicts()[-1]
            assert last["weight_version"] == "step-1" and last["error"] is None
            assert last["completion_logprobs"] == rows[3]["completion_logprobs"]
            rec = json.loads((logs / "weight-syncs.jsonl").read_text().splitlines()[-1])
            assert rec["outcome"] == "failed" and rec["target_version"] == "step-2" and rec["weight_version"] == "step-1"
            # the original weights back, through the proxy: the original logprobs again
            r = httpx.post(px.url + "/polar/@weights", json={"path": str(tiny_model_dir()), "version": original},
                           timeout=300)
            assert r.status_code == 200 and r.json()["weight_version"] == original, r.text
            assert post(px.url, greedy(model), e)[0] == 200
            again = read_log(logs / f"{e}.arrow").sort("call_index").to_dicts()[-1]
            assert again["weight_version"] == original
            assert again["completion_logprobs"] == rows[0]["completion_logprobs"]
    finally:
        restore(vllm_url, original)
