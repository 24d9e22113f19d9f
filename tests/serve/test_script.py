"""Scripted mode: stateless turn choice, tool resolution against the request, Qwen3-exact text."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from polar_contracts.assets import data_path
from polar_contracts.chat.render import RequestError, render_chat, render_rules
from polar_serve.dialects import DIALECTS
from polar_serve.parsers import parse_output
from polar_serve.script import ScriptError, choose_reply, load_script, turn_index, validate_script

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness-requests"
SCRIPT = data_path("scripts", "create_hello.json")


def _bodies(name):
    return [json.loads(line)["body"] for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def tok(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def script():
    return load_script(SCRIPT)


@pytest.mark.parametrize("name,tool", [("qwen-code", "run_shell_command"), ("pi", "bash")])
def test_recorded_requests_get_turns_0_1_2_and_the_declared_shell_tool(script, name, tool):
    bodies = _bodies(name)
    assert [turn_index(b) for b in bodies] == [0, 1, 2]
    replies = [choose_reply(script, b, thinking=True) for b in bodies]
    assert [r.source for r in replies] == ["turn 0", "turn 1", "fallback"]
    assert f'<tool_call>\n{{"name": "{tool}", "arguments": {{"command": "echo hi > hello.txt"}}}}\n</tool_call>' \
        in replies[0].text
    assert replies[0].text.startswith("<think>\nThe user wants hello.txt")
    assert "<tool_call>" not in replies[2].text


def test_argument_names_follow_the_declared_schema(script):
    exec_tool = {"type": "function", "function": {"name": "exec_command", "parameters": {
        "type": "object", "properties": {"cmd": {"type": "string"}}}}}
    body = {"messages": [{"role": "user", "content": "go"}], "tools": [exec_tool]}
    r = choose_reply(script, body, thinking=False)
    assert '{"name": "exec_command", "arguments": {"cmd": "echo hi > hello.txt"}}' in r.text
    assert not r.text.startswith("<think>")  # thinking off: the prompt already holds the empty block


def test_argv_shell_tool_gets_bash_lc(script):
    shell = {"type": "function", "function": {"name": "shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}}}}
    r = choose_reply(script, {"messages": [{"role": "user", "content": "go"}], "tools": [shell]}, thinking=True)
    assert '"arguments": {"command": ["bash", "-lc", "echo hi > hello.txt"]}' in r.text


def test_no_tools_rule_and_unresolvable_tool(script):
    r = choose_reply(script, {"messages": [{"role": "user", "content": "title please"}]}, thinking=True)
    assert r.source == "rule 0" and r.text.endswith("Create hello.txt")
    body = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "read"}}]}
    with pytest.raises(RequestError, match=r"calls one of .*run_shell_command.* declares tools \['read'\]"):
        choose_reply(script, body, thinking=True)


@pytest.mark.parametrize("bad,needle", [
    ({"turns": [{"contents": "x"}]}, "unknown keys"),
    ({"turns": [{"tool_calls": [{"arguments": {}}]}]}, "needs a 'tool'"),
    ({"rules": [{"reply": {}}]}, "needs 'when'"),
    ({"rules": [{"when": {"tool": 1}, "reply": {}}]}, "unknown keys"),
    ({"turn_index": "random"}, "turn_index"),
])
def test_malformed_scripts_are_named(bad, needle):
    with pytest.raises(ScriptError, match=needle):
        validate_script(bad)


def test_scripted_turn_re_renders_token_for_token(tok, script):
    """The scripted output is laid out exactly as the template renders the same assistant turn, so
    prompt + completion of a call is a token prefix of the next call's prompt (SGLang's stripped
    content, and pi which sends reasoning_content back)."""
    bodies = _bodies("pi")
    body0 = bodies[0]
    _, p0 = render_chat(tok, body0, render_rules("sglang"))
    reply = choose_reply(script, body0, thinking=True)
    c0 = tok.encode(reply.text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    parsed = parse_output(reply.text, DIALECTS["sglang"], True, True, {"bash"})
    assistant = {"role": "assistant", "content": parsed.content, "reasoning_content": parsed.reasoning,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                                for t in parsed.tool_calls]}
    tool_result = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    body1 = dict(body0, messages=body0["messages"] + [assistant, tool_result])
    _, p1 = render_chat(tok, body1, render_rules("sglang"))
    assert p1[:len(p0) + len(c0)] == p0 + c0
