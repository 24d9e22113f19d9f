"""weight_version on every row, through a real mitmdump in front of polar-serve, before and after a
``POST /polar/reload``: from the ``x-polar-weight-version`` header (every API, streamed or not)
and from SGLang's ``meta_info.weight_version`` (non-streaming chat: the proxy asks for
``return_meta_info`` and removes ``meta_info`` again). The SGLang server here names its output ids
``token_ids`` (newer SGLang, ``--sglang-token-ids-field token_ids``); test_polar_serve_e2e.py
covers the default ``response_token_ids``."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest

from polar_contracts.log.reader import read_log
from tests.support.servers import polar_serve, tiny_model_dir

from .procs import mitmdump
from .test_polar_serve_e2e import SCRIPT, call, norm

CASES = {"vllm": ("vllm", []), "sglang-token_ids": ("sglang", ["--sglang-token-ids-field", "token_ids"])}


@pytest.fixture(scope="module", params=list(CASES))
def served(request, tmp_path_factory):
    dialect, extra = CASES[request.param]
    work = tmp_path_factory.mktemp(f"wv-{request.param}")
    with polar_serve(tiny_model_dir(), dialect, script=SCRIPT, extra_args=extra) as srv:
        with mitmdump(work, work / "logs", upstream=srv.base_url, sets={"polar_dialect": dialect}) as px:
            model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            yield dialect, srv, px, work / "logs", model


def _calls(srv, px, model, e):
    """One call per API x stream through the proxy; the non-stream chat answer is compared with
    the server's own (same request, no proxy)."""
    chat = {"model": model, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "Please create hello.txt"}]}
    comp = {"model": model, "max_tokens": 4, "temperature": 0, "prompt": "Hello"}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
        for stream in (False, True):
            st, raw = call(px.url + path, {**body, "stream": stream}, episode=e, stream=stream)
            assert st == 200, raw[:300]
            if path.endswith("chat/completions") and not stream:
                _, direct = call(srv.base_url + path, body)
                assert norm(raw) == norm(direct)  # no meta_info / ids the proxy caused
                assert b"meta_info" not in raw
                assert b'token_ids"' not in raw or b'"prompt_token_ids":null' in raw.replace(b" ", b"")  # vLLM: null
    return 4


def test_weight_version_before_and_after_reload(served):
    dialect, srv, px, logdir, model = served
    e = "wv-" + uuid.uuid4().hex[:8]
    n = _calls(srv, px, model, e)
    r = httpx.post(srv.base_url + "/polar/reload", json={"model": str(tiny_model_dir()), "weight_version": "step-2"},
                   timeout=120)
    assert r.status_code == 200 and r.json()["weight_version"] == "step-2"
    n += _calls(srv, px, model, e)
    df = read_log(logdir / f"{e}.arrow")
    assert df.height == n
    assert df["error"].to_list() == [None] * n, df["error"].to_list()
    assert df["weight_version"].to_list() == ["default"] * (n // 2) + ["step-2"] * (n // 2)
    assert all(df["completion_ids"].to_list()) and all(df["prompt_ids"].to_list())
    if dialect == "sglang":  # the token_ids shape: ids equal what the server says with its own flags
        body = {"model": model, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                "messages": [{"role": "user", "content": "Please create hello.txt"}]}
        _, truth = call(srv.base_url + "/v1/chat/completions", body)
        ch = json.loads(truth)["choices"][0]
        assert "token_ids" in ch and "response_token_ids" not in ch
        row = df.row(n // 2, named=True)  # the non-stream chat call after the reload
        assert row["api"] == "chat" and row["stream"] is False
        assert row["completion_ids"] == ch["token_ids"] and row["prompt_ids"] == ch["prompt_token_ids"]
        # the harness asking for the ids itself keeps them (only what the proxy caused is removed)
        _, raw = call(px.url + "/v1/chat/completions", body, episode=e)
        assert norm(raw) == norm(truth)
