"""Prompt rendering: ids equal the tokenizer's own apply_chat_template, and the two servers differ
where docs/reference.md ("Wire formats") says they do."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from polar_contracts.chat.render import RequestError, render_chat, render_rules, template_messages, template_tools

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness-requests"
TOOL = {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {
    "command": {"type": "string"}}, "required": ["command"]}}}


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def _bodies():
    for name in ("qwen-code", "pi"):
        for i, line in enumerate((FIXTURES / f"{name}.jsonl").read_text().splitlines()):
            yield f"{name}-{i}", json.loads(line)["body"]


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
def test_prompt_ids_equal_apply_chat_template_tokenize_true(tok, dialect):
    for name, body in _bodies():
        text, ids = render_chat(tok, body, render_rules(dialect))
        msgs = template_messages(body["messages"], render_rules(dialect))
        tools = template_tools(body.get("tools"), body.get("tool_choice", "auto"), render_rules(dialect))
        ref = tok.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ids == list(ref), name
        assert text.endswith("<|im_start|>assistant\n")


def test_text_parts_join_newline_vllm_space_sglang(tok):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}
    assert "<|im_start|>user\na\nb<|im_end|>" in render_chat(tok, body, render_rules("vllm"))[0]
    assert "<|im_start|>user\na b<|im_end|>" in render_chat(tok, body, render_rules("sglang"))[0]


def test_tool_null_fields_differ(tok):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL]}
    v = render_chat(tok, body, render_rules("vllm"))[0]
    s = render_chat(tok, body, render_rules("sglang"))[0]
    assert '{"type": "function", "function": {"name": "bash", "description": null, "parameters":' in v
    # SGLang 0.5.23: Tool.model_dump(), the function in the client's key order (test_sglang_render.py)
    assert '{"type": "function", "function": {"name": "bash", "parameters":' in s
    assert '"description": null}, "defer_loading": null}' in s
    assert "defer_loading" not in v


def test_tool_choice_none_drops_tools_only_on_sglang(tok):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL], "tool_choice": "none"}
    assert "# Tools" in render_chat(tok, body, render_rules("vllm"))[0]
    assert "# Tools" not in render_chat(tok, body, render_rules("sglang"))[0]


def test_enable_thinking_false_and_continue_final_message(tok):
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}}
    assert render_chat(tok, body, render_rules("vllm"))[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "partial"}],
            "continue_final_message": True, "add_generation_prompt": False}
    assert render_chat(tok, body, render_rules("vllm"))[0].endswith("partial")


def test_vllm_turns_developer_into_system_and_merges_the_systems(tok):
    """vLLM 0.32 (measured): with a developer message, every system text goes into one first system message."""
    body = {"messages": [{"role": "system", "content": "A."}, {"role": "developer", "content": "B."},
                         {"role": "user", "content": "hi"}, {"role": "system", "content": "C."}]}
    text = render_chat(tok, body, render_rules("vllm"))[0]
    assert text.startswith("<|im_start|>system\nA.\n\nB.\n\nC.<|im_end|>\n<|im_start|>user\nhi<|im_end|>")
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]}
    assert "<|im_start|>system\nlate" in render_chat(tok, body, render_rules("vllm"))[0]  # no developer: as sent


def test_tool_call_arguments_are_reserialized_by_the_template(tok):
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    for d in ("vllm", "sglang"):
        text = render_chat(tok, {"messages": msgs}, render_rules(d))[0]
        assert '{"name": "bash", "arguments": {"command": "ls"}}' in text


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "non-empty"),
    ({"messages": [{"role": 5, "content": "x"}]}, "role"),  # a custom role name is fine (vLLM 0.32 takes it)
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "a", "arguments": "{bad"}}]}]}, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
])
def test_bad_requests_name_the_problem(tok, body, needle):
    with pytest.raises(RequestError) as e:
        render_chat(tok, body, render_rules("vllm"))
    assert needle in str(e.value)
