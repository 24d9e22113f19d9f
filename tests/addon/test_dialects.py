import copy

import pytest

from addon import chat
from addon.call_tokens import CallTokens as CallCapture
from addon.server_dialects import dialect_from_models, plan_request, strip_response


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
    ("sglang", "chat", False, {"logprobs": True, "return_prompt_token_ids": True, "return_token_ids": True,
                               "return_meta_info": True}),
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


def _sglang_answer(out_key: str, with_prompt: bool, meta: bool) -> dict:
    ch = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": {"content": [
        {"token": "hi", "logprob": -0.5}, {"token": "", "logprob": -0.1}]}, "finish_reason": "stop", out_key: [5, 6]}
    if with_prompt:
        ch["prompt_token_ids"] = [1, 2, 3]
    if meta:
        ch["meta_info"] = {"id": "x", "weight_version": "v7"}
    return {"id": "c", "choices": [ch]}


@pytest.mark.parametrize("out_key", ["response_token_ids", "token_ids"])
def test_sglang_chat_ids_in_either_field_and_removed(out_key):
    """Output ids in response_token_ids (SGLang 0.5.23, docs/reference.md "Wire formats") or token_ids (newer SGLang): both are
    captured, and the answer the harness gets has neither, nor meta_info, nor the logprobs."""
    plan = plan_request("chat", "sglang", {"stream": False})
    obj = _sglang_answer(out_key, True, True)
    cap = CallCapture(plan)
    chat.extract(cap, obj)
    row = cap.rows()[0]
    assert row["prompt_ids"].tolist() == [1, 2, 3] and row["completion_ids"].tolist() == [5, 6]
    assert row["missing"] is None and cap.weight_version == "v7"
    assert strip_response(plan, obj) is True
    assert obj["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                 "finish_reason": "stop"}


@pytest.mark.parametrize("out_key", ["response_token_ids", "token_ids"])
def test_sglang_chat_harness_own_flags_kept(out_key):
    """What the harness asked for itself stays in its answer; only what the proxy caused goes."""
    body = {"return_token_ids": True, "return_meta_info": True, "logprobs": True}
    plan = plan_request("chat", "sglang", body)
    assert plan.added == {"return_prompt_token_ids": True}
    obj = _sglang_answer(out_key, True, True)
    want = copy.deepcopy(obj)  # 0.5.23 (_build_chat_response): return_token_ids gives the prompt ids too
    strip_response(plan, obj)
    assert obj == want


def test_vllm_harness_return_token_ids_kept():
    plan = plan_request("chat", "vllm", {"return_token_ids": True})
    assert plan.added == {"logprobs": True}
    obj = {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2], "logprobs": {"content": []}}]}
    strip_response(plan, obj)
    assert obj == {"prompt_token_ids": [1], "choices": [{"index": 0, "token_ids": [2], "logprobs": None}]}


def test_sglang_stream_harness_output_ids_kept():
    plan = plan_request("chat", "sglang", {"stream": True, "return_output_ids_in_sglext": True, "logprobs": True})
    assert plan.added == {"return_input_ids_in_sglext": True}
    obj = {"choices": [], "sglext": {"input_ids": [1], "output_ids": [[2]]}}
    assert strip_response(plan, obj) is True and obj == {"choices": [], "sglext": {"output_ids": [[2]]}}
