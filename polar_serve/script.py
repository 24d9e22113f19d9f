"""Scripted mode: a script file decides the assistant text per turn; the model only scores it.

A random tiny model cannot drive a harness, so with `--script FILE` the server does not sample:
it picks a reply from the script, renders it exactly as Qwen3 emits an assistant turn, tokenizes
it with the real tokenizer, reports the served model's real (teacher-forced) logprobs of those
tokens, and sends the text through the same reasoning / tool parsers as sampled output.

Script format (JSON; comments not allowed):

    {
      "turns": [                                   # reply k answers the request whose turn index is k
        {"reasoning": "The user wants hello.txt.",  # optional; rendered as <think>...</think>
         "content": "I'll create the file.",        # optional text after the reasoning
         "tool_calls": [                            # optional
           {"tool": {"any_of": ["run_shell_command", "bash", "shell", "exec_command", "Bash"]},
            "arguments": {"command": "echo hi > hello.txt"},
            "argument_names": {"exec_command": {"command": "cmd"}}}   # optional per-tool renames
         ],
         "delay": 0.2},                             # optional seconds of simulated generation time
        {"content": "Done: hello.txt contains hi."}
      ],
      "rules": [                                   # checked first, in order; first match wins
        {"when": {"tools": false}, "reply": {"content": "Create hello.txt"}}
      ],
      "fallback": {"content": "Done."},            # when the turns are exhausted
      "turn_index": "assistant_after_last_user"    # or "assistant_total" / "tool_results"
    }

Turn selection is stateless: the turn index is computed from the request alone -
`assistant_after_last_user` (default) counts assistant messages after the last user message, so a
harness's first call of a task gets turn 0, the call after one tool round gets turn 1, and so on.

`when` conditions (all must hold): `tools` (bool: the request declares tools), `tool_declared`
(name or list: one of them is declared), `last_user_contains`, `system_contains`, `any_contains`
(substring of any message text), `turn` (int: the computed turn index), `stream` (bool).

A tool reference is a name (`"tool": "bash"`) or `{"any_of": [...]}`: the first name of the list
that the request declares is used; a reference no declared tool satisfies is a 400 naming both
lists. Arguments: `arguments` is the default; `arguments_by_tool` {name: {...}} overrides it per
tool; `argument_names` {name: {from: to}} renames keys per tool. A key the chosen tool's JSON schema
does not declare is also renamed through the built-in aliases (command <-> cmd) when that
makes it a declared key (Codex's `exec_command` takes `cmd`, Claude's `Bash` takes `command`), and a
string given for an array-typed parameter becomes `["bash", "-lc", string]` (argv-style shell tools).

A reply may instead give `"text"`: the raw assistant output (without <|im_end|>), used verbatim,
`"token_ids"`: the exact output token ids, end-of-turn token included (e.g. ids a real server produced,
replayed token for token: tests/vllm/test_differential.py), or `"sample": true`: the model samples this reply as without a script.
Rendering: with thinking enabled, a reply without `reasoning` starts with the empty
`<think>\\n\\n</think>\\n\\n` block, as Qwen3 does; with `enable_thinking: false` the prompt already
holds that block, so the reply starts with its content.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polar_contracts.chat.render import RequestError

ALIASES = {"command": ("cmd",), "cmd": ("command",)}
TURN_MODES = ("assistant_after_last_user", "assistant_total", "tool_results")
REPLY_KEYS = {"reasoning", "content", "tool_calls", "delay", "text", "sample", "token_ids"}
WHEN_KEYS = {"tools", "tool_declared", "last_user_contains", "system_contains", "any_contains", "turn", "stream"}


class ScriptError(ValueError):
    """The script file itself is malformed (reported at startup, naming the bad entry)."""


@dataclass
class ScriptedReply:
    text: str | None   # the assistant output, without the end-of-turn token; None = let the model sample
    delay: float
    source: str        # "turn 0", "rule 1", "fallback": for logs and tests
    token_ids: list[int] | None = None  # exact output ids (then `text` is unused)


def _check_reply(r: Any, where: str) -> None:
    if not isinstance(r, dict):
        raise ScriptError(f"{where} must be an object")
    bad = set(r) - REPLY_KEYS
    if bad:
        raise ScriptError(f"{where} has unknown keys {sorted(bad)} (allowed: {sorted(REPLY_KEYS)})")
    for i, tc in enumerate(r.get("tool_calls") or []):
        if not isinstance(tc, dict) or "tool" not in tc:
            raise ScriptError(f"{where}.tool_calls[{i}] needs a 'tool'")
        t = tc["tool"]
        if not (isinstance(t, str) or (isinstance(t, dict) and isinstance(t.get("any_of"), list))):
            raise ScriptError(f"{where}.tool_calls[{i}].tool must be a name or {{'any_of': [names]}}")
    ids = r.get("token_ids")
    if ids is not None and not (isinstance(ids, list) and ids and all(type(x) is int for x in ids)):
        raise ScriptError(f"{where}.token_ids must be a non-empty list of token ids")
    if "delay" in r and not isinstance(r["delay"], (int, float)):
        raise ScriptError(f"{where}.delay must be a number of seconds")


def load_script(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ScriptError(f"script file {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise ScriptError(f"script file {p} is not valid JSON: {e}") from None
    return validate_script(data, str(p))


def validate_script(data: Any, name: str = "script") -> dict:
    if not isinstance(data, dict):
        raise ScriptError(f"{name}: the top level must be an object")
    bad = set(data) - {"turns", "rules", "fallback", "turn_index", "description"}
    if bad:
        raise ScriptError(f"{name}: unknown keys {sorted(bad)}")
    if data.get("turn_index", TURN_MODES[0]) not in TURN_MODES:
        raise ScriptError(f"{name}: turn_index must be one of {TURN_MODES}")
    for i, t in enumerate(data.get("turns", [])):
        _check_reply(t, f"{name}: turns[{i}]")
    for i, r in enumerate(data.get("rules", [])):
        if not isinstance(r, dict) or not isinstance(r.get("when"), dict) or "reply" not in r:
            raise ScriptError(f"{name}: rules[{i}] needs 'when' (object) and 'reply'")
        bad = set(r["when"]) - WHEN_KEYS
        if bad:
            raise ScriptError(f"{name}: rules[{i}].when has unknown keys {sorted(bad)} (allowed: {sorted(WHEN_KEYS)})")
        _check_reply(r["reply"], f"{name}: rules[{i}].reply")
    if "fallback" in data:
        _check_reply(data["fallback"], f"{name}: fallback")
    return data


# -- request facts --------------------------------------------------------------------------------
def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def declared_tools(body: dict) -> dict[str, dict]:
    out = {}
    for t in body.get("tools") or []:
        fn = (t or {}).get("function") or {}
        if isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {}
    return out


def turn_index(body: dict, mode: str = TURN_MODES[0]) -> int:
    msgs = body.get("messages") or []
    if mode == "assistant_total":
        return sum(1 for m in msgs if m.get("role") == "assistant")
    if mode == "tool_results":
        return sum(1 for m in msgs if m.get("role") == "tool")
    last_user = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=-1)
    return sum(1 for m in msgs[last_user + 1:] if m.get("role") == "assistant")


def _matches(when: dict, body: dict, turn: int) -> bool:
    msgs = body.get("messages") or []
    tools = declared_tools(body)
    if "tools" in when and bool(tools) != bool(when["tools"]):
        return False
    if "tool_declared" in when:
        names = when["tool_declared"] if isinstance(when["tool_declared"], list) else [when["tool_declared"]]
        if not any(n in tools for n in names):
            return False
    if "turn" in when and when["turn"] != turn:
        return False
    if "stream" in when and bool(body.get("stream")) != bool(when["stream"]):
        return False
    users = [m for m in msgs if m.get("role") == "user"]
    if "last_user_contains" in when and not (users and when["last_user_contains"] in _text(users[-1].get("content"))):
        return False
    systems = [_text(m.get("content")) for m in msgs if m.get("role") in ("system", "developer")]
    if "system_contains" in when and not any(when["system_contains"] in s for s in systems):
        return False
    if "any_contains" in when and not any(when["any_contains"] in _text(m.get("content")) for m in msgs):
        return False
    return True


# -- rendering ------------------------------------------------------------------------------------
def _resolve_tool(ref: Any, tools: dict[str, dict], where: str) -> str:
    names = [ref] if isinstance(ref, str) else list(ref["any_of"])
    for n in names:
        if n in tools:
            return n
    raise RequestError(f"scripted {where} calls one of {names}, but the request declares tools {sorted(tools)}")


def _arguments(tc: dict, name: str, schema: dict) -> dict:
    args = dict((tc.get("arguments_by_tool") or {}).get(name, tc.get("arguments") or {}))
    for src, dst in ((tc.get("argument_names") or {}).get(name) or {}).items():
        if src in args:
            args[dst] = args.pop(src)
    props = schema.get("properties") if isinstance(schema, dict) else None
    if isinstance(props, dict) and props:
        for key in list(args):
            if key not in props:
                for alias in ALIASES.get(key, ()):
                    if alias in props and alias not in args:
                        args[alias] = args.pop(key)
                        break
        for key, value in args.items():
            # Shell tools that take argv (e.g. Codex's legacy `shell`): run the string through bash.
            if isinstance(value, str) and (props.get(key) or {}).get("type") == "array":
                args[key] = ["bash", "-lc", value]
    return args


def render_reply(reply: dict, body: dict, thinking: bool, where: str) -> str:
    """The assistant output text exactly as Qwen3 would emit it (the chat template's own layout)."""
    if "text" in reply:
        return reply["text"]
    tools = declared_tools(body)
    out = ""
    if thinking:
        out += "<think>\n" + (reply.get("reasoning") or "").strip("\n") + "\n</think>\n\n"
    content = (reply.get("content") or "").lstrip("\n")
    out += content
    for i, tc in enumerate(reply.get("tool_calls") or []):
        name = _resolve_tool(tc["tool"], tools, f"{where} tool_calls[{i}]")
        args = _arguments(tc, name, tools[name])
        if i > 0 or content:
            out += "\n"
        arguments = json.dumps(args, ensure_ascii=False)
        out += '<tool_call>\n{"name": "' + name + '", "arguments": ' + arguments + "}\n</tool_call>"
    return out


def choose_reply(script: dict, body: dict, thinking: bool) -> ScriptedReply:
    turn = turn_index(body, script.get("turn_index", TURN_MODES[0]))
    for i, rule in enumerate(script.get("rules", [])):
        if _matches(rule["when"], body, turn):
            return _make(rule["reply"], body, thinking, f"rule {i}")
    turns = script.get("turns", [])
    if turn < len(turns):
        return _make(turns[turn], body, thinking, f"turn {turn}")
    fb = script.get("fallback", {"content": "Done."})
    return _make(fb, body, thinking, "fallback")


def _make(reply: dict, body: dict, thinking: bool, where: str) -> ScriptedReply:
    if reply.get("sample"):
        return ScriptedReply(None, float(reply.get("delay", 0.0)), where)
    if reply.get("token_ids"):
        return ScriptedReply("", float(reply.get("delay", 0.0)), where, list(reply["token_ids"]))
    return ScriptedReply(render_reply(reply, body, thinking, where), float(reply.get("delay", 0.0)), where)
