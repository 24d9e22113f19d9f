"""The recorded real Codex CLI and Claude Code requests translate to chat bodies that the real
Qwen3 chat template renders with the system prompt, the tools and the whole history."""
from __future__ import annotations

import itertools
import json
import pathlib

import pytest
from transformers import AutoTokenizer

from polar_contracts.translate import translator_for

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "harness-requests"


def _calls(name: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()
            if line.strip()]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(ROOT / "data" / "tokenizers" / "qwen3"))


def _render(tok, chat: dict) -> str:
    kwargs = chat.get("chat_template_kwargs") or {}
    return tok.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=False,
                                   add_generation_prompt=True, **kwargs)


def _translate(call: dict):
    t = translator_for(call["method"], call["path"])
    assert t is not None, call["path"]
    chat = t.request_to_chat(call["body"], call["headers"])
    json.dumps(chat)  # a plain JSON body
    return t, chat


def _assert_chat_shape(chat: dict) -> None:
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    for m in chat["messages"]:
        assert m["role"] in ("system", "user", "assistant", "tool"), m["role"]
        assert isinstance(m["content"], str), "the Qwen3 template drops non-string content"
    for t in chat["tools"]:
        assert t["type"] == "function" and t["function"]["name"]
        assert isinstance(t["function"]["parameters"], dict)
    for key in ("return_token_ids", "logprobs", "return_prompt_token_ids"):
        assert key not in chat, "token-id flags are the plumbing's job"


def test_codex_requests_render_with_system_tools_history(tokenizer):
    calls = _calls("codex")
    prompts = []
    for call in calls:
        t, chat = _translate(call)
        assert t.api == "responses" and not t.auxiliary
        _assert_chat_shape(chat)
        prompt = _render(tokenizer, chat)
        body = call["body"]
        developer = [i for i in body["input"] if i.get("role") == "developer"]
        for item in developer:
            for part in item["content"]:
                assert part["text"] in prompt
        assert prompt.startswith("<|im_start|>system\n" + developer[0]["content"][0]["text"])
        names = [t["name"] for t in body["tools"] if t["type"] == "function"]
        names += [i["name"] for t in body["tools"] if t["type"] == "namespace" for i in t["tools"]]
        for name in names:
            assert f'"name": "{name}"' in prompt, name
        assert '"web_search"' not in prompt
        assert any("web_search" in n for n in t.notes)
        for item in body["input"]:
            if item.get("role") == "user":
                assert item["content"][0]["text"] in prompt
            elif item.get("type") == "function_call":
                args = json.loads(item["arguments"])
                assert f'<tool_call>\n{{"name": "{item["name"]}", "arguments": ' in prompt
                assert json.dumps(args) in prompt
            elif item.get("type") == "function_call_output":
                assert f"<tool_response>\n{item['output']}\n</tool_response>" in prompt
            elif item.get("type") == "reasoning":
                assert "<think>\n" + item["summary"][0]["text"] + "\n</think>" in prompt
        assert chat["chat_template_kwargs"] == {"enable_thinking": True}
        prompts.append(prompt)
    # Each call's prompt extends the previous one: translation keeps the history stable.
    for a, b in itertools.pairwise(prompts):
        assert b.startswith(a), "a later Codex prompt must extend the earlier one"


def test_claude_code_requests_render_with_system_tools_history(tokenizer):
    prompts = []
    for call in _calls("claude-code"):
        t, chat = _translate(call)
        assert t.api == "messages" and not t.auxiliary
        _assert_chat_shape(chat)
        prompt = _render(tokenizer, chat)
        body = call["body"]
        assert "x-anthropic-billing-header" not in prompt
        assert any("billing-header" in n for n in t.notes)
        assert any("cache_control" in n for n in t.notes)
        assert "metadata recorded, not forwarded" in t.notes
        assert t.metadata == body["metadata"]
        system = "".join(b["text"] for b in body["system"][1:])
        assert prompt.startswith("<|im_start|>system\n" + system + "\n\n# Tools")
        for tool in body["tools"]:
            assert f'"name": "{tool["name"]}"' in prompt
        for m in body["messages"]:
            blocks = [{"type": "text", "text": m["content"]}] if isinstance(m["content"], str) \
                else m["content"]
            for b in blocks:
                if b["type"] == "text":
                    assert b["text"] in prompt
                elif b["type"] == "thinking":
                    assert "<think>\n" + b["thinking"] + "\n</think>" in prompt
                elif b["type"] == "tool_use":
                    assert json.dumps({"name": b["name"], "arguments": b["input"]},
                                      ensure_ascii=False) in prompt
                elif b["type"] == "tool_result":
                    assert f"<tool_response>\n{b['content']}\n</tool_response>" in prompt
            if m["role"] == "system":
                assert f"<|im_start|>system\n{m['content']}<|im_end|>" in prompt
        assert chat["max_tokens"] == body["max_tokens"]
        assert chat["chat_template_kwargs"] == {"enable_thinking": True}
        prompts.append(prompt)
    for a, b in itertools.pairwise(prompts):
        assert b.startswith(a), "a later Claude Code prompt must extend the earlier one"


def test_normalizations_can_be_turned_off():
    call = _calls("claude-code")[0]
    t = translator_for("POST", call["path"], normalize=False)
    chat = t.request_to_chat(call["body"], call["headers"])
    assert chat["messages"][0]["content"].startswith("x-anthropic-billing-header")
    assert not any("billing" in n for n in t.notes)


@pytest.mark.parametrize("method,path,api", [
    ("POST", "/v1/responses", "responses"), ("POST", "/v1/messages?beta=true", "messages"),
    ("POST", "/messages", "messages"), ("POST", "/responses/", "responses"),
    ("post", "/v1/messages", "messages"),
    ("GET", "/v1/messages", None), ("POST", "/v1/chat/completions", None),
    ("POST", "/v1/messages/count_tokens", None), ("POST", "/v1/responses/compact", None)])
def test_routing(method, path, api):
    t = translator_for(method, path)
    assert (t.api if t else None) == api
    if t:
        assert translator_for(method, path) is not t, "a new translator per call"


def test_responses_request_fields():
    t = translator_for("POST", "/v1/responses")
    chat = t.request_to_chat({
        "model": "m", "instructions": "Be brief.", "input": "hi", "max_output_tokens": 77,
        "temperature": 0.3, "top_p": 0.9, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "reasoning": {"effort": "none"}, "frobnicate": 1, "stream": False}, {})
    assert chat["messages"] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}]
    assert chat["max_tokens"] == 77 and chat["temperature"] == 0.3 and chat["top_p"] == 0.9
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}
    assert "reasoning_effort" not in chat
    assert chat["stream"] is False and "stream_options" not in chat
    assert "dropped unknown field frobnicate" in t.notes
    assert not t.auxiliary  # it has tools


def test_messages_request_fields_and_title_call():
    t = translator_for("POST", "/v1/messages")
    chat = t.request_to_chat({
        "model": "m", "max_tokens": 100, "system": "You write titles.",
        "messages": [{"role": "user", "content": "create hello.txt"}],
        "stop_sequences": ["###"], "temperature": 0.5, "top_k": 20,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"title": {"type": "string"}}}}}}, {})
    assert t.auxiliary and any("auxiliary" in n for n in t.notes)
    assert chat["stop"] == ["###"] and chat["top_k"] == 20 and chat["temperature"] == 0.5
    assert chat["tool_choice"] == "required" and chat["parallel_tool_calls"] is False
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}  # no `thinking` asked
    assert chat["response_format"]["type"] == "json_schema"
    for kind, want in (("auto", "auto"), ("none", "none"),
                       ("tool", {"type": "function", "function": {"name": "Bash"}})):
        t2 = translator_for("POST", "/v1/messages")
        c2 = t2.request_to_chat({"model": "m", "max_tokens": 5, "messages": [
            {"role": "user", "content": "x"}], "tool_choice": {"type": kind, "name": "Bash"},
            "thinking": {"type": "enabled", "budget_tokens": 1000}}, {})
        assert c2["tool_choice"] == want
        assert c2["chat_template_kwargs"] == {"enable_thinking": True}


def test_messages_tool_result_content_list_and_is_error(tokenizer):
    t = translator_for("POST", "/v1/messages")
    chat = t.request_to_chat({"model": "m", "max_tokens": 10, "messages": [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_2", "name": "Bash", "input": {"command": "pwd"}}]},
        {"role": "system", "content": "Reminder between call and results."},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": "<tool_use_error>boom</tool_use_error>"},
            {"type": "text", "text": "and now?"}]}]}, {})
    roles = [m["role"] for m in chat["messages"]]
    # The inline system message moves after the results it would have split from their calls.
    assert roles == ["user", "assistant", "tool", "tool", "system", "user"]
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "a\nb"}
    assert any("is_error" in n for n in t.notes)
    prompt = _render(tokenizer, chat)
    assert "<tool_response>\na\nb\n</tool_response>\n<tool_response>\n<tool_use_error>" in prompt


def test_messages_prefill_continues_the_last_assistant_turn(tokenizer):
    t = translator_for("POST", "/v1/messages")
    chat = t.request_to_chat({"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "Pick A or B"},
        {"role": "assistant", "content": "The answer is ("}]}, {})
    assert chat["continue_final_message"] is True and chat["add_generation_prompt"] is False
    prompt = tokenizer.apply_chat_template(chat["messages"], tokenize=False,
                                           continue_final_message=True)
    # Qwen3 renders the last assistant turn with a (here empty) think block before the text.
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nThe answer is (")


def test_billing_line_inside_a_system_string_removes_only_that_line():
    t = translator_for("POST", "/v1/messages")
    chat = t.request_to_chat({"model": "m", "max_tokens": 5, "messages": [USER_MSG],
                              "system": "x-anthropic-billing-header: cc_version=1;\nBe helpful."},
                             {})
    assert chat["messages"][0] == {"role": "system", "content": "Be helpful."}


USER_MSG = {"role": "user", "content": "hi"}
