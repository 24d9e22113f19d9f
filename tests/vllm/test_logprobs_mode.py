"""The real vLLM 0.32 in processed mode (the session's server: local_stack.VLLM_FLAGS) behind the addon:
the logprobs-mode probe says ``processed``, and a request without sampling fields, proxied with
``polar_generation_config`` = the tiny model (Qwen3's T=0.6, top_k=20, top_p=0.95), is recorded
with those values AND sampled with them: its row's ids and logprobs are those of the same request
sent directly with the values spelled out (same seed), and not those of other values.
(The stock, raw-mode server's probe is in test_harness_vllm.py, which starts that server anyway.)
``POLAR_TEST_VLLM_URL`` points the module at a running vLLM (processed mode, serving polar-model)."""
from __future__ import annotations

import json
import os
import urllib.request

import pytest

from addon.logprobs_probe import probe_upstream
from harness_recipes.node.local_stack import capture_proxy
from polar_contracts.log.reader import read_log
from tests.conftest import VLLM_MODEL_NAME

QWEN3 = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}


@pytest.fixture(scope="module")
def vllm_url(request):
    return os.environ.get("POLAR_TEST_VLLM_URL") or request.getfixturevalue("real_vllm").url


def post(url: str, body: dict, episode: str | None = None) -> dict:
    headers = {"content-type": "application/json", **({"x-polar-episode": episode} if episode else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def body(**extra) -> dict:
    # 3 tokens: top_p < 1 sorts the vocabulary on vLLM's CPU path, slow here
    return {"model": VLLM_MODEL_NAME, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3,
            "seed": 7, "logprobs": True, "return_token_ids": True, **extra}


def lps(answer: dict) -> list[float]:
    return [e["logprob"] for e in answer["choices"][0]["logprobs"]["content"]]


def test_the_probe_says_processed(vllm_url):
    assert probe_upstream(vllm_url, VLLM_MODEL_NAME) == "processed"


def test_rows_carry_the_sampling_vllm_applied(vllm_url, tiny_model, tmp_path):
    with capture_proxy(vllm_url, tmp_path / "logs", control_secret=None, sets={"polar_generation_config": str(tiny_model)}) as px:
        got = post(px.url, body(), "ep")
    (row,) = read_log(tmp_path / "logs" / "ep.arrow").iter_rows(named=True)
    assert row["error"] is None, row["error"]
    assert {k: row[k] for k in (*QWEN3, "logprobs_mode", "sampling_unsupported")} == {
        **QWEN3, "logprobs_mode": "processed", "sampling_unsupported": None}
    direct = post(vllm_url, body(**QWEN3))
    assert row["completion_ids"] == direct["choices"][0]["token_ids"] == got["choices"][0]["token_ids"]
    assert row["completion_logprobs"] == pytest.approx(lps(direct), abs=1e-5)
    # processed logprobs of a top_k=20 / top_p=0.95 distribution: other settings give other values
    untruncated = post(vllm_url, body(temperature=0.6, top_k=-1, top_p=1.0, min_p=0.0))
    assert lps(untruncated)[0] != pytest.approx(row["completion_logprobs"][0], abs=1e-3)
