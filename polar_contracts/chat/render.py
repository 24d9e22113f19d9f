"""Chat-template rendering exactly as vLLM and SGLang 0.5.23 prepare a request for the template.

One rule set per server (`RenderRules`, below): polar-serve renders its prompts with them and the
`retokenize` baseline of reconstruction renders conversations with them, so both follow the same
reading of the servers.

Sources followed (read through the code index; see docs/reference.md, "Wire formats", for the byte-exact findings):
- vLLM `entrypoints/chat_utils.py` (`_parse_chat_message_content`, `_postprocess_messages`) and
  `chat_completion/protocol.py` (`ChatCompletionToolsParam`, `FunctionDefinition`): text content parts
  are joined with "\\n" for a "string"-format template such as Qwen3's; assistant tool-call
  `arguments` strings are json-decoded into dicts (the template then re-serializes them with
  `tojson`); a `reasoning` / `reasoning_content` on an assistant message is passed as both names;
  tools are `tool.model_dump()` = {"type", "function": {"name", "description" (null kept),
  "parameters", <extra keys>}} and stay in the prompt even with `tool_choice: "none"`.
- SGLang 0.5.23: render_sglang.py (rules `SGLANG_RENDER` dispatch there): its pydantic models'
  dumps (`Tool.model_dump()` = {"type", "function": {...in the client's key order...},
  "defer_loading"}), text parts joined with " ", tools left out with `tool_choice: "none"`, a
  final assistant turn rendered as a user turn (or cut off and appended as ids with
  `continue_final_message`); tests/serve/test_sglang_render.py checks it against the wheel's code.
The template itself is the tokenizer's own (`tokenizer.apply_chat_template`), never re-implemented.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from polar_contracts.chat import RequestError, content_parts, part_text, render_sglang


def _join_parts(content: Any, sep: str, where: str) -> Any:
    parts = content_parts(content, where)
    if parts is None:
        return content
    texts = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict) or "type" not in part:
            raise RequestError(f"{where}.content[{i}] must be an object with a 'type'")
        if part["type"] in ("text", "input_text", "output_text"):
            texts.append(part_text(part, i, where))
        elif part["type"] in ("image_url", "input_image", "audio_url", "video_url", "input_audio"):
            raise RequestError(f"{where}.content[{i}]: the served model is text-only ({part['type']!r} given)")
    return sep.join(texts)


def _decode_arguments(tool_calls: Any, where: str) -> list:
    if not isinstance(tool_calls, list):
        raise RequestError(f"{where}.tool_calls must be a list")
    out = copy.deepcopy(tool_calls)
    for j, tc in enumerate(out):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}.tool_calls[{j}].function.name is required")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError as e:
                raise RequestError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON: {e}") from None
    return out


@dataclass(frozen=True)
class RenderRules:
    """How one server prepares a chat request for the chat template. vLLM's rules are the functions
    of this module; SGLang's differ in almost every step and live whole in render_sglang.py, which
    each entry point below hands an SGLang request to."""
    name: str
    part_separator: str                 # text content parts of one message are joined with this
    reasoning_aliases: tuple[str, ...]  # names an assistant turn's reasoning is passed under


VLLM_RENDER = RenderRules("vllm", "\n", ("reasoning_content", "reasoning"))
SGLANG_RENDER = RenderRules("sglang", " ", ("reasoning_content",))  # see render_sglang.py
RENDER_RULES = {r.name: r for r in (VLLM_RENDER, SGLANG_RENDER)}


def render_rules(dialect: str | None) -> RenderRules:
    """The rules of a log row's `dialect` (a row that names none renders as vLLM does)."""
    try:
        return RENDER_RULES[dialect or "vllm"]
    except KeyError:
        raise ValueError(f"unknown server dialect {dialect!r} (known: {', '.join(RENDER_RULES)})") from None


def template_messages(messages: Any, rules: RenderRules) -> list[dict]:
    """The message dicts the server hands to the chat template."""
    if rules.name == "sglang":
        return render_sglang.template_messages(messages)[0]
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    sep = rules.part_separator
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{where} must be an object")
        role = m.get("role")
        if not isinstance(role, str):  # vLLM also takes custom roles (CustomChatCompletionMessageParam)
            raise RequestError(f"{where}.role must be a string (got {role!r})")
        if role == "user" and "content" not in m:
            raise RequestError(f"{where}.content is required for a user message")
        msg: dict[str, Any] = {"role": role}
        msg["content"] = _join_parts(m.get("content"), sep, where)
        if m.get("tool_calls") is not None and role == "assistant":
            msg["tool_calls"] = _decode_arguments(m["tool_calls"], where)
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if role == "assistant" and reasoning is not None:
            for name in rules.reasoning_aliases:
                msg[name] = reasoning
        out.append(msg)
    return _developer_as_system(out)


def _developer_as_system(msgs: list[dict]) -> list[dict]:
    """vLLM (renderers/hf.py, checked on 0.32.0): when a `developer` message is present and the template
    knows no developer role (Qwen3's does not), developer becomes system and ALL system messages merge
    into one first message, their texts joined with a blank line."""
    if not any(m["role"] == "developer" for m in msgs):
        return msgs
    msgs = [dict(m, role="system") if m["role"] == "developer" else m for m in msgs]
    at = [i for i, m in enumerate(msgs) if m["role"] == "system"]
    if at == [0]:
        return msgs
    texts = [m["content"] for m in msgs if m["role"] == "system" and m.get("content")]
    return [{"role": "system", "content": "\n\n".join(texts)}, *(m for m in msgs if m["role"] != "system")]


def _check_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}].function.name is required")
        if t.get("type", "function") != "function":
            raise RequestError(f"tools[{i}].type must be 'function'")
    return tools


def template_tools(tools: Any, tool_choice: Any, rules: RenderRules) -> list[dict] | None:
    """The tool dicts the server passes as `tools=` to the chat template (None = no tools)."""
    if rules.name == "sglang":
        return render_sglang.template_tools({"tools": tools, "tool_choice": tool_choice})
    if tools is None:
        return None
    out = []
    for t in _check_tools(tools):  # vLLM keeps every tool, whatever the tool_choice
        fn = t["function"]
        f = {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}
        f.update({k: v for k, v in fn.items() if k not in f})  # extra="allow" keeps unknown keys
        d = {"type": "function", "function": f}
        if t.get("defer_loading") is not None:
            d["defer_loading"] = t["defer_loading"]
        out.append(d)
    return out or None


def template_kwargs(body: dict) -> dict:
    """add_generation_prompt / continue_final_message / chat_template_kwargs of a chat request."""
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise RequestError("'chat_template_kwargs' must be an object")
    cont = bool(body.get("continue_final_message", False))
    agp = body.get("add_generation_prompt", not cont)
    if cont and agp:
        raise RequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
    effort = body.get("reasoning_effort")
    kw = dict(kw)
    if effort == "none":
        kw.setdefault("enable_thinking", False)
    return {"add_generation_prompt": bool(agp), "continue_final_message": cont, **kw}


def render_text(tokenizer, body: dict, rules: RenderRules) -> str:
    """The chat request rendered by the model's own template as the server renders it."""
    if rules.name == "sglang":
        text, prefix = render_sglang.render(tokenizer, body)
        return text + (prefix or "")
    msgs = template_messages(body.get("messages"), rules)
    tools = template_tools(body.get("tools"), body.get("tool_choice", "auto"), rules)
    kw = template_kwargs(body)
    try:
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, **kw)
    except Exception as e:  # template errors (e.g. continue_final_message on a non-assistant turn)
        raise RequestError(f"chat template failed: {e}") from None


def render_chat(tokenizer, body: dict, rules: RenderRules) -> tuple[str, list[int]]:
    """Rendered prompt text and its token ids for a chat request."""
    if rules.name == "sglang":
        return render_sglang.render_chat(tokenizer, body)
    text = render_text(tokenizer, body, rules)
    return text, tokenizer.encode(text, add_special_tokens=False)


def thinking_enabled(body: dict) -> bool:
    kw = body.get("chat_template_kwargs") or {}
    if body.get("reasoning_effort") == "none":
        return bool(kw.get("enable_thinking", False))
    return bool(kw.get("enable_thinking", True)) if isinstance(kw, dict) else True
