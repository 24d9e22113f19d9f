"""The proxy re-learns a server restarted between calls with another --logprobs-mode: real mitmdump with
the addon, real polar-serve stopped and started again on the same port. No call fails meanwhile (the
client opens a new connection per call), so only the new upstream connection tells the proxy."""
from __future__ import annotations

import httpx

from harness_recipes.node.local_stack import serve
from harness_recipes.node.processes import free_port
from polar_contracts.log.reader import read_log
from tests.support.servers import tiny_model_dir

from .procs import mitmdump


def one_call(proxy_url: str, episode: str) -> None:
    with httpx.Client(timeout=120) as c:  # a new client connection: mitmdump opens a new upstream one
        r = c.post(proxy_url + "/v1/chat/completions", headers={"x-polar-episode": episode},
                   json={"model": "polar-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_restarted_server_is_relearned(tmp_path):
    port, logdir = free_port(), tmp_path / "logs"
    upstream = f"http://127.0.0.1:{port}"

    def start(mode: str):
        return serve(tiny_model_dir(), None, "vllm", extra_args=["--port", port], logprobs_mode=mode,
                     log=tmp_path / f"serve-{mode}.log")

    # (no script: a scripted reply's logprobs are not the sampled distribution the probe reads)
    with mitmdump(tmp_path, logdir, upstream=upstream, sets={"polar_identity_recheck_s": "0"}) as px:
        with start("raw_logprobs"):
            one_call(px.url, "before")
            one_call(px.url, "before")
        with start("processed_logprobs"):
            one_call(px.url, "after")
    recorded = {ep: read_log(logdir / f"{ep}.arrow")["logprobs_mode"].to_list() for ep in ("before", "after")}
    assert recorded == {"before": ["raw", "raw"], "after": ["processed"]}
