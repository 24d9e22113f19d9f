"""The logprobs-mode probe race (`make demo` used to fail on it): calls that arrive while the probe of a
cold, slow upstream is in flight must wait for it, so that every row of a run carries the mode.

A small front in front of polar-serve holds the probe's requests (one-token chat calls with
`top_logprobs: 2`) for longer than the proxy's old 10 s wait; two episodes' first calls arrive at once.
"""
from __future__ import annotations

import http.server
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx

from harness_recipes.node.local_stack import serve
from polar_contracts.log.reader import read_log
from tests.support.servers import tiny_model_dir

from .procs import mitmdump

PROBE_HOLD_S = 12.0  # longer than the 10 s a call used to wait before recording null


def slow_probe_front(upstream: str) -> tuple[http.server.ThreadingHTTPServer, list[float]]:
    held: list[float] = []

    class Front(http.server.BaseHTTPRequestHandler):
        def _forward(self, body: bytes | None):
            if body and b'"top_logprobs": 2' in body.replace(b'"top_logprobs":2', b'"top_logprobs": 2'):
                held.append(time.monotonic())
                time.sleep(PROBE_HOLD_S)
            req = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                         headers={k: v for k, v in self.headers.items() if k.lower() != "host"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    status, data, ctype = r.status, r.read(), r.headers.get("content-type", "application/json")
            except urllib.error.HTTPError as e:
                status, data, ctype = e.code, e.read(), "application/json"
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's names)
            self._forward(None)

        def do_POST(self):  # noqa: N802
            self._forward(self.rfile.read(int(self.headers.get("content-length") or 0)))

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Front)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, held


def test_calls_that_arrive_during_a_slow_probe_wait_and_record_the_mode(tmp_path):
    with serve(tiny_model_dir(), dialect="vllm", logprobs_mode="processed_logprobs") as srv:
        front, held = slow_probe_front(srv.base_url)
        try:
            logdir = tmp_path / "logs"
            with mitmdump(tmp_path, logdir, upstream=f"http://127.0.0.1:{front.server_address[1]}",
                          sets={"termlog_verbosity": "warn", "polar_generation_config": str(tiny_model_dir())},
                          quiet=False) as px:
                body = {"model": "polar-model", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 3}

                def call(ep: str) -> int:
                    r = httpx.post(px.url + "/v1/chat/completions", json=body, timeout=180,
                                   headers={"x-polar-episode": ep})
                    return r.status_code

                with ThreadPoolExecutor(2) as pool:  # the first calls of two episodes, at once
                    assert list(pool.map(call, ["e0", "e1"])) == [200, 200]
                assert call("e0") == 200  # a later call: the mode is cached
        finally:
            front.shutdown()
    assert held, "the probe never went through the slow front: the test tested nothing"
    modes = [m for ep in ("e0", "e1") for m in read_log(logdir / f"{ep}.arrow")["logprobs_mode"].to_list()]
    assert modes == ["processed"] * 3, modes
