"""Episode end while a call is still streaming (the call's row is never lost), and the translators'
integration in the addon (a TranslationError answered in the harness API's own error shape), in a
real mitmdump against the fake backend."""
from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest

from polar_contracts.log.reader import read_episode, read_log

from .procs import fake_backend, mitmdump

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "héllo"}], "stream": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One backend, two proxies: the default end wait (5 s) and one that answers /end at once."""
    work = tmp_path_factory.mktemp("end")
    with fake_backend(work, "vllm", chunks=12) as be, \
            mitmdump(work, work / "logs", upstream=be.url, sets={"polar_dialect": "vllm"}) as px, \
            mitmdump(work, work / "logs0", upstream=be.url,
                     sets={"polar_dialect": "vllm", "polar_end_wait_ms": "0"}) as px0:
        yield be, px, work / "logs", px0, work / "logs0"


def ep() -> str:
    return "e-" + uuid.uuid4().hex[:10]


class SlowStream(threading.Thread):
    """A streaming call (fake backend 'slow': 12 chunks 50 ms apart) read to its end in a thread;
    ``started`` is set once the first bytes arrived, so the call is surely in flight."""

    def __init__(self, url: str, episode: str):
        super().__init__(daemon=True)
        self.url, self.episode = url, episode
        self.started = threading.Event()
        self.raw = b""
        self.status = None

    def run(self):
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", self.url + "/v1/chat/completions", json=CHAT,
                          headers={"x-polar-episode": self.episode, "x-fake": "slow"}) as r:
                self.status = r.status_code
                for chunk in r.iter_raw():
                    self.raw += chunk
                    self.started.set()
        self.started.set()


def _end(url: str, e: str, reward: float):
    r = httpx.post(url + f"/polar/{e}/end", json={"reward": reward, "metadata": {"k": 1}}, timeout=30)
    return r.status_code, r.json()


def test_end_waits_for_the_inflight_stream(stack):
    _, px, logdir, _, _ = stack
    e = ep()
    assert httpx.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": False},
                      headers={"x-polar-episode": e}, timeout=30).status_code == 200
    s = SlowStream(px.url, e)
    s.start()
    assert s.started.wait(10)
    t0 = time.time()
    st, body = _end(px.url, e, 1.0)
    waited = time.time() - t0
    s.join(10)
    assert st == 200 and body == {"episode_id": e, "calls": 2, "reward": 1.0, "ended": True}
    assert waited > 0.1  # it really waited for the stream (12 x 50 ms)
    assert s.status == 200 and s.raw.endswith(b"data: [DONE]\n\n")
    log = read_episode(logdir / f"{e}.arrow")
    assert log.finished and log.reward == 1.0 and log.calls.height == 2
    assert log.calls["error"].to_list() == [None, None]
    assert log.calls["stream"].to_list() == [False, True]


def test_end_answered_at_once_then_written_after_the_stream(stack):
    _, _, _, px0, logdir0 = stack
    e = ep()
    s = SlowStream(px0.url, e)
    s.start()
    assert s.started.wait(10)
    st, body = _end(px0.url, e, 0.25)
    assert st == 202 and body["ended"] is False and body["pending_calls"] == 1, body
    # a new call to an ending episode is refused clearly (not lost in a finished file)
    r = httpx.post(px0.url + "/v1/chat/completions", json={**CHAT, "stream": False},
                   headers={"x-polar-episode": e}, timeout=30)
    assert r.status_code == 409 and "ending" in r.text
    assert _end(px0.url, e, 0.5)[0] == 409  # a second end while ending
    assert not read_episode(logdir0 / f"{e}.arrow").finished  # still running: the stream is in flight
    s.join(10)
    assert s.raw.endswith(b"data: [DONE]\n\n")
    deadline = time.time() + 10
    while time.time() < deadline and not read_episode(logdir0 / f"{e}.arrow").finished:
        time.sleep(0.05)
    log = read_episode(logdir0 / f"{e}.arrow")
    assert log.finished and log.reward == 0.25 and log.metadata == {"k": 1}
    assert log.calls.height == 1 and log.calls["error"][0] is None and log.calls["completion_ids"][0] is not None
    assert _end(px0.url, e, 1.0)[0] == 409  # ended for good


def test_end_after_a_disconnected_stream_still_ends(stack):
    """A harness that goes away mid-stream: the call's row (with its error) and then the end record."""
    _, px, logdir, _, _ = stack
    e = ep()
    done = {}

    def end_later():
        done["r"] = _end(px.url, e, 0.0)

    with httpx.Client(timeout=30) as c:
        with c.stream("POST", px.url + "/v1/chat/completions", json=CHAT,
                      headers={"x-polar-episode": e, "x-fake": "slow"}) as r:
            next(r.iter_raw())
            t = threading.Thread(target=end_later)
            t.start()
            time.sleep(0.1)
    t.join(15)
    assert done["r"][0] == 200 and done["r"][1]["calls"] == 1
    log = read_episode(logdir / f"{e}.arrow")
    assert log.finished and "disconnect" in log.calls["error"][0].lower()


def test_translation_error_in_the_apis_own_shape(stack):
    be, px, logdir, _, _ = stack
    e = ep()
    body = {"model": "fake-model", "max_tokens": 10, "messages": []}  # Messages needs a non-empty list
    r = httpx.post(px.url + "/v1/messages", json=body, headers={"x-polar-episode": e}, timeout=30)
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "non-empty" in err["error"]["message"] and "polar proxy" not in err["error"]["message"]
    row = read_log(logdir / f"{e}.arrow").row(0, named=True)
    assert row["status"] == 400 and row["api"] == "messages"
    assert "translator" in row["error"] and "non-empty" in row["error"] and row["completion_ids"] is None
    assert json.loads(row["request"]) == body
    # Responses: its own error shape too; and the proxy keeps serving
    r = httpx.post(px.url + "/v1/responses", json={"model": "fake-model", "input": []},
                   headers={"x-polar-episode": e}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(px.url + "/v1/chat/completions", json={**CHAT, "stream": False},
                      headers={"x-polar-episode": e}, timeout=30).status_code == 200
