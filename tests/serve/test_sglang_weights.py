"""polar-serve's SGLang dialect: the weight endpoints as SGLang 0.5.23 answers them
(entrypoints/http_server.py: /model_info 812-848, /update_weights_from_disk 1300-1327,
/update_weight_version 1527-1555; managers/tokenizer_manager.py 2288-2322: the version moves
only on success), and the version on each answer (meta_info / metadata) following the weights."""
from __future__ import annotations

import httpx
import pytest

from harness_recipes.demo.weights import perturbed_copy
from tests.support.servers import polar_serve


@pytest.fixture(scope="module")
def sgl(tiny_model, tmp_path_factory):
    new = perturbed_copy(tiny_model, tmp_path_factory.mktemp("sglw") / "new", scale=0.2)
    with polar_serve(tiny_model, "sglang", extra_args=["--threads", "1"]) as h:
        h.new, h.orig = new, tiny_model
        yield h


def greedy(h) -> tuple[dict, dict]:
    """(choice, answer) of a greedy chat call with logprobs and meta_info."""
    body = {"model": "m", "max_tokens": 4, "temperature": 0, "logprobs": True, "return_meta_info": True,
            "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(h.base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0], r.json()


def same_weights(a: dict, b: dict) -> bool:
    """Two greedy answers' logprobs come from the same weights: the same tokens, logprobs within
    1e-4. Not bit-equal: the second call reuses the first one's prefix cache, so its prompt is
    summed in another order (float32 rounding, ~1e-6); the perturbed weights move them by ~0.1."""
    ta, tb = a["content"], b["content"]
    return ([t["token"] for t in ta] == [t["token"] for t in tb]
            and all(abs(x["logprob"] - y["logprob"]) < 1e-4 for x, y in zip(ta, tb, strict=True)))


def test_update_weights_from_disk(sgl):
    info = httpx.get(sgl.base_url + "/model_info").json()
    assert info["weight_version"] == "default" and info["model_path"] == str(sgl.orig)
    # SGLang 0.5.23's fields (entrypoints/http_server.py model_info, a text model: no "embedding");
    # model_path is where a proxy reads the served model's sampling defaults (addon/sampling_discovery.py)
    assert list(info) == ["model_path", "served_model_name", "tokenizer_path", "is_generation",
                          "preferred_sampling_params", "weight_version", "load_format", "reasoning_parser",
                          "tool_call_parser", "disaggregation_mode", "has_image_understanding",
                          "has_audio_understanding", "model_type", "architectures"]
    assert info["preferred_sampling_params"] is None and info["model_type"] == "qwen3"
    assert httpx.get(sgl.base_url + "/get_model_info").json() == info  # the deprecated alias
    ch0, a0 = greedy(sgl)
    assert ch0["meta_info"]["weight_version"] == "default" and a0["metadata"] == {"weight_version": "default"}

    r = httpx.post(sgl.base_url + "/update_weights_from_disk",
                   json={"model_path": str(sgl.new), "weight_version": "v1", "flush_cache": True}, timeout=120)
    assert r.status_code == 200
    assert r.json() == {"success": True, "message": "Succeeded to update model weights. Weight version updated to v1.",
                        "num_paused_requests": 0}
    assert httpx.get(sgl.base_url + "/model_info").json()["weight_version"] == "v1"
    ch1, a1 = greedy(sgl)
    assert ch1["meta_info"]["weight_version"] == "v1" and a1["metadata"] == {"weight_version": "v1"}
    assert not same_weights(ch1["logprobs"], ch0["logprobs"])  # the new weights serve

    # a load that fails: 400, success false, the weights and the version stay
    r = httpx.post(sgl.base_url + "/update_weights_from_disk",
                   json={"model_path": "/no/such/model", "weight_version": "v2"}, timeout=120)
    assert r.status_code == 400
    b = r.json()
    assert b["success"] is False and b["num_paused_requests"] == 0
    assert b["message"].startswith("Failed to get weights iterator: ") and "/no/such/model" in b["message"]
    assert httpx.get(sgl.base_url + "/model_info").json()["weight_version"] == "v1"
    assert same_weights(greedy(sgl)[0]["logprobs"], ch1["logprobs"])

    # without weight_version: the weights change, the version does not
    r = httpx.post(sgl.base_url + "/update_weights_from_disk", json={"model_path": str(sgl.orig)}, timeout=120)
    assert r.json() == {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
    assert httpx.get(sgl.base_url + "/model_info").json()["weight_version"] == "v1"
    assert same_weights(greedy(sgl)[0]["logprobs"], ch0["logprobs"])

    r = httpx.post(sgl.base_url + "/update_weight_version", json={"new_version": "default"})
    assert r.json() == {"success": True, "message": "Weight version updated to default", "new_version": "default"}


@pytest.mark.parametrize("body, field", [({}, "model_path"), ({"model_path": 3}, "model_path"),
                                         ({"model_path": "/x", "weight_version": 2}, "weight_version")])
def test_update_weights_from_disk_validation(sgl, body, field):
    r = httpx.post(sgl.base_url + "/update_weights_from_disk", json=body)
    assert r.status_code == 400  # SGLang answers pydantic's validation errors with 400 (http_server.py:635)
    assert r.json()["object"] == "error" and field in r.json()["message"]
