import pytest

from addon.dialects import dialect_from_models, plan_request


def test_auto_detection_from_models_owned_by():
    assert dialect_from_models({"data": [{"id": "m", "owned_by": "vllm"}]}) == "vllm"
    assert dialect_from_models({"data": [{"id": "m", "owned_by": "sglang"}]}) == "sglang"
    assert dialect_from_models({"data": [{"id": "m", "owned_by": "openai"}]}) is None
    assert dialect_from_models({"data": []}) is None
    assert dialect_from_models("nonsense") is None


@pytest.mark.parametrize("dialect,api,stream,added", [
    ("vllm", "chat", True, {"logprobs": True, "return_token_ids": True}),
    ("vllm", "chat", False, {"logprobs": True, "return_token_ids": True}),
    ("vllm", "completions", True, {"logprobs": 0, "return_token_ids": True}),
    ("sglang", "chat", True, {"logprobs": True, "return_input_ids_in_sglext": True, "return_output_ids_in_sglext": True}),
    ("sglang", "chat", False, {"logprobs": True, "return_prompt_token_ids": True, "return_token_ids": True}),
    ("sglang", "completions", False, {"logprobs": 1, "return_token_ids": True}),
])
def test_flags_per_dialect(dialect, api, stream, added):
    plan = plan_request(api, dialect, {"stream": stream})
    assert plan.added == added
    # never include_usage or include_reasoning: the harness's usage chunk and reasoning stay its own
    assert "stream_options" not in plan.added and "include_reasoning" not in plan.added


def test_harness_logprobs_not_overridden():
    assert "logprobs" not in plan_request("chat", "vllm", {"logprobs": True, "top_logprobs": 3}).added
    assert "logprobs" not in plan_request("completions", "sglang", {"logprobs": 2}).added


def test_unknown_dialect():
    with pytest.raises(ValueError, match="unknown dialect"):
        plan_request("chat", "tgi", {})
