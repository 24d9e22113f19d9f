"""Qwen3 reasoning and tool-call parsing as vLLM 0.33 and SGLang 0.5.23 do it (sans-IO).

Sources followed:
- vLLM `reasoning/qwen3_reasoning_parser.py`: partition on `<think>` then on `</think>`, no
  whitespace stripping; with thinking enabled, output without `</think>` is all reasoning.
  `tool_parsers/hermes_tool_parser.py`: content = text before the first `<tool_call>` (kept as is,
  None when empty); each `<tool_call>{json}</tool_call>` becomes a call whose `arguments` is
  `json.dumps(args, ensure_ascii=False)`; ids `chatcmpl-tool-<32 hex>`.
- SGLang `srt/parser/reasoning_parser.py` (Qwen3Detector, `force_reasoning` = thinking enabled):
  `<think>` removed, text `.strip()`ped, split on `</think>`, content `.strip()`ped.
  `srt/function_call/qwen25_detector.py`: normal text = text before `<tool_call>\\n`, stripped;
  blocks `<tool_call>\\n(.*?)\\n</tool_call>`; calls to tools the request did not declare are dropped;
  ids `call_<24 hex>`.

Streaming: `StreamParser.feed(full_text)` re-parses the whole text produced so far and emits only
what is new, so the concatenated deltas always equal the non-streaming parse of the final text
(property-tested). Tool-call arguments are emitted once the call's JSON is complete; the name as
soon as it is known, like the real parsers.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"
_NAME_RE = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class ToolCallOut:
    name: str
    arguments: str | None  # None while the call's JSON is incomplete (streaming)
    id: str = ""


@dataclass
class Parsed:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallOut] = field(default_factory=list)


def new_tool_call_id(dialect: str) -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}" if dialect == "vllm" else f"call_{uuid.uuid4().hex[:24]}"


def split_reasoning(text: str, dialect: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, rest) of a model output."""
    if dialect == "vllm":
        if not thinking and THINK_START not in text:
            return None, text
        before, tag, after = text.partition(THINK_START)
        body = after if tag else before
        if THINK_END not in body:
            return body, ""
        reasoning, _, rest = body.partition(THINK_END)
        return reasoning, rest
    if not thinking and THINK_START not in text:
        return None, text
    body = text.replace(THINK_START, "").strip()
    if THINK_END not in body:
        return body, ""
    reasoning, rest = body.split(THINK_END, 1)
    return reasoning, rest.strip()


def _parse_call(raw: str) -> tuple[str, str] | None:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], json.dumps(args if args is not None else {}, ensure_ascii=False)


def split_tools_vllm(rest: str, partial: bool) -> tuple[str | None, list[ToolCallOut], bool]:
    """Hermes: (content, calls, ok). ok=False means a complete block failed to parse (-> plain text)."""
    if TOOL_START not in rest:
        return (rest or None), [], True
    content = rest[:rest.find(TOOL_START)]
    calls = []
    for m in re.finditer(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", rest, re.DOTALL):
        if m.group(1) is not None:
            c = _parse_call(m.group(1))
            if c is None:
                return None, [], False
            calls.append(ToolCallOut(c[0], c[1]))
        else:
            tail = m.group(2)
            c = _parse_call(tail)
            if c is not None and not partial:
                calls.append(ToolCallOut(c[0], c[1]))
            elif partial:
                nm = _NAME_RE.search(tail)
                if nm:
                    calls.append(ToolCallOut(json.loads(f'"{nm.group(1)}"'), None))
            else:
                return None, [], False
    return (content or None), calls, True


def split_tools_sglang(rest: str, tool_names: set[str] | None, partial: bool) -> tuple[str | None, list[ToolCallOut], bool]:
    bot, eot = TOOL_START + "\n", "\n" + TOOL_END
    idx = rest.find(bot)
    if idx == -1:
        return (rest or None), [], True
    content = rest[:idx].strip()
    calls = []
    pos = idx
    while True:
        start = rest.find(bot, pos)
        if start == -1:
            break
        end = rest.find(eot, start + len(bot))
        if end == -1:
            if partial:
                nm = _NAME_RE.search(rest[start + len(bot):])
                if nm:
                    name = json.loads(f'"{nm.group(1)}"')
                    if tool_names is None or name in tool_names:
                        calls.append(ToolCallOut(name, None))
            break
        c = _parse_call(rest[start + len(bot):end].strip())
        if c is not None and (tool_names is None or c[0] in tool_names):
            calls.append(ToolCallOut(c[0], c[1]))
        pos = end + len(eot)
    return (content or None), calls, True


def parse_output(text: str, dialect: str, thinking: bool, tools_active: bool,
                 tool_names: set[str] | None = None, partial: bool = False) -> Parsed:
    """Split a (possibly partial) model output into reasoning, content and tool calls."""
    reasoning, rest = split_reasoning(text, dialect, thinking)
    if not tools_active:
        return Parsed(reasoning, rest or None, [])
    if dialect == "vllm":
        content, calls, ok = split_tools_vllm(rest, partial)
    else:
        content, calls, ok = split_tools_sglang(rest, tool_names, partial)
    if not ok:
        return Parsed(reasoning, rest or None, [])
    return Parsed(reasoning, content, calls)


class StreamParser:
    """Turns the growing output text into reasoning / content / tool-call deltas."""

    def __init__(self, dialect: str, thinking: bool, tools_active: bool, tool_names: set[str] | None = None):
        self.dialect, self.thinking, self.tools_active, self.tool_names = dialect, thinking, tools_active, tool_names
        self.sent_reasoning = ""
        self.sent_content = ""
        self.sent_calls: list[ToolCallOut] = []  # arguments = what was sent ("" before any)

    def feed(self, text: str, final: bool = False) -> list[dict]:
        """Deltas for `text` (the whole output so far): {"reasoning"|"content": str} or
        {"tool_call": {"index", "id"?, "name"?, "arguments"?}}."""
        if not final:
            # A tag split over tokens (never with Qwen3's single-token tags, but possible for other
            # tokenizers) must not leak as text: parse without a trailing partial tag.
            for tag in (THINK_START, THINK_END, TOOL_START, TOOL_END):
                cut = _hold_back(text, tag)
                if len(cut) < len(text) and not text.endswith(tag):
                    text = cut
                    break
        p = parse_output(text, self.dialect, self.thinking, self.tools_active, self.tool_names, partial=not final)
        out = []
        r = p.reasoning or ""
        if len(r) > len(self.sent_reasoning) and r.startswith(self.sent_reasoning):
            out.append({"reasoning": r[len(self.sent_reasoning):]})
            self.sent_reasoning = r
        c = p.content or ""
        if not self.sent_calls and len(c) > len(self.sent_content) and c.startswith(self.sent_content):
            # Hold back a possible start of "<tool_call>" split over tokens.
            safe = c if final else _hold_back(c, TOOL_START + "\n")
            if self.dialect == "sglang" and not final:
                safe = safe.rstrip()  # SGLang strips the text before a call: trailing space may vanish
            if len(safe) > len(self.sent_content):
                out.append({"content": safe[len(self.sent_content):]})
                self.sent_content = safe
        for i, call in enumerate(p.tool_calls):
            if i >= len(self.sent_calls):
                tc = ToolCallOut(call.name, "", new_tool_call_id(self.dialect))
                self.sent_calls.append(tc)
                out.append({"tool_call": {"index": i, "id": tc.id, "name": call.name}})
            sent = self.sent_calls[i]
            if call.arguments is not None and sent.arguments == "" and call.arguments:
                sent.arguments = call.arguments
                out.append({"tool_call": {"index": i, "arguments": call.arguments}})
        return out


def _hold_back(text: str, tag: str) -> str:
    for k in range(min(len(tag), len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text
