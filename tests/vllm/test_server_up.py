"""The real vLLM starts from its own environment and answers with token ids (the smoke test every
other real-vLLM test builds on)."""
from __future__ import annotations

import json
import urllib.request

from tests.conftest import VLLM_MODEL_NAME


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_real_vllm_serves_the_tiny_model_with_token_ids(real_vllm):
    with urllib.request.urlopen(real_vllm.url + "/v1/models", timeout=30) as r:
        models = json.loads(r.read())
    assert [m["id"] for m in models["data"]] == [VLLM_MODEL_NAME] and models["data"][0]["owned_by"] == "vllm"
    out = _post(real_vllm.url + "/v1/chat/completions",
                {"model": VLLM_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                 "temperature": 0, "return_token_ids": True, "logprobs": True})
    choice = out["choices"][0]
    assert len(choice["token_ids"]) == 4 and len(out["prompt_token_ids"]) > 5
    assert [e["logprob"] <= 0 for e in choice["logprobs"]["content"]] == [True] * 4
    assert out["system_fingerprint"].startswith("vllm-0.32.0")
