"""Qwen3 reasoning and tool-call parsing as vLLM 0.32 and SGLang 0.5.23 do it (sans-IO).

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

Streaming: `StreamParser.feed(full_text)` re-parses the text produced so far and emits only what
is new, so the concatenated deltas always equal the non-streaming parse of the final text
(property-tested). Tool calls: the id and name as soon as the name is complete, then argument
fragments as far as they are certain, the rest when the call's JSON ends (see StreamParser).
Where the real servers' streams differ from their own non-streamed answer we keep the sum exact:
vLLM's newest hermes parser streams the model's RAW argument text (brace-matched), which differs
from the re-serialized non-streamed `arguments` when the model's spacing is not json.dumps' (Qwen
models write json.dumps' spacing, so the fragments usually coincide); SGLang's streaming path
serializes with `json.dumps(args)` (ASCII escapes: "\u00e9" where the answer has "é").
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .jsonstream import JsonScanner

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


def split_reasoning_vllm(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, rest) of a model output, as vLLM's qwen3 reasoning parser splits it."""
    if not thinking and THINK_START not in text:
        return None, text
    before, tag, after = text.partition(THINK_START)
    body = after if tag else before
    if THINK_END not in body:
        return body, ""
    reasoning, _, rest = body.partition(THINK_END)
    return reasoning, rest


def split_reasoning_sglang(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning, rest) of a model output, as SGLang's qwen3 reasoning parser splits it."""
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
    for body, closed in tool_regions(rest, TOOL_START, TOOL_END):
        if closed:
            c = _parse_call(body)
            if c is None:
                return None, [], False
            calls.append(ToolCallOut(c[0], c[1]))
        else:
            tail = body
            if partial:  # no json.loads of a growing tail on every token
                nm = _NAME_RE.search(tail)
                if nm:
                    calls.append(ToolCallOut(json.loads(f'"{nm.group(1)}"'), None))
                continue
            c = _parse_call(tail)
            if c is None:
                return None, [], False
            calls.append(ToolCallOut(c[0], c[1]))
    return (content or None), calls, True


def split_tools_sglang(rest: str, tool_names: set[str] | None,
                       partial: bool) -> tuple[str | None, list[ToolCallOut], bool]:
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


def parse_output(text: str, dialect, thinking: bool, tools_active: bool,
                 tool_names: set[str] | None = None, partial: bool = False) -> Parsed:
    """Split a (possibly partial) model output into reasoning, content and tool calls, by the
    rules of `dialect` (a dialect.Dialect)."""
    reasoning, rest = dialect.split_reasoning(text, thinking)
    if not tools_active:
        return Parsed(reasoning, rest or None, [])
    content, calls, ok = dialect.split_tools(rest, tool_names, partial)
    if not ok:
        return Parsed(reasoning, rest or None, [])
    return Parsed(reasoning, content, calls)


@dataclass
class _CallStream:
    """One streamed tool call: its OpenAI index and id, and how much of its arguments was sent."""
    index: int
    id: str
    args: JsonScanner = field(default_factory=JsonScanner)
    sent: str = ""
    lag: str | None = None     # SGLang: what was certain at the previous feed (it diffs one step behind)


def tool_regions(rest: str, bot: str, eot: str) -> list[tuple[str, bool]]:
    """(body, closed) of each `<tool_call>` region, delimited by the tool parser's `bot` / `eot`."""
    # vLLM's regex `<tool_call>(.*?)</tool_call>|<tool_call>(.*)` (DOTALL), as str.find: the lazy
    # regex rescans a long open call on every token.
    out, pos = [], 0
    while (start := rest.find(bot, pos)) != -1:
        end = rest.find(eot, start + len(bot))
        if end == -1:
            out.append((rest[start + len(bot):], False))
            break
        out.append((rest[start + len(bot):end], True))
        pos = end + len(eot)
    return out


def certain_arguments(outer: JsonScanner, body: str, args: JsonScanner) -> str:
    """The part of a call's final `arguments` string that the body seen so far already fixes."""
    m = outer.members.get("arguments")
    if m is not None:
        raw = body[m.start:]
        text = args.feed(raw)
        if raw.startswith("n"):  # "arguments": null -> "{}" (both servers), known once "null" is whole
            return "{}" if args.done else ""
        return text
    if not outer.done:
        return ""  # "parameters" counts only if no "arguments" follows: wait for the whole object
    p = outer.members.get("parameters")
    if p is None or p.end is None:
        return "{}"
    value = json.loads(body[p.start:p.end])
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


class StreamParser:
    """Turns the growing output text into reasoning / content / tool-call deltas.

    Tool calls stream like the real parsers: a first delta with the id and name (as soon as the
    name string is complete), then argument fragments. Fragments are prefixes of the final
    `json.dumps(arguments, ensure_ascii=False)` (jsonstream.JsonScanner), so they add up to the
    non-streamed `arguments` exactly.
    - vLLM (hermes, extract_tool_calls_streaming): each feed sends all newly certain argument
      text; name and first fragment may share one DeltaMessage.
    - SGLang (BaseFormatDetector.parse_streaming_increment): the name alone (wire: `arguments: ""`);
      no arguments in the next feed; then each feed sends what was already certain one feed
      earlier (SGLang diffs the previous and current partial parse); the rest when the call's
      JSON object is complete. Calls to undeclared tools are skipped (no index used).
    """

    def __init__(self, dialect, thinking: bool, tools_active: bool, tool_names: set[str] | None = None):
        self.dialect, self.thinking, self.tools_active, self.tool_names = dialect, thinking, tools_active, tool_names
        self.sent_reasoning = ""
        self.sent_content = ""
        self.scanners: list[JsonScanner] = []     # one per <tool_call> region
        self.calls: dict[int, _CallStream] = {}   # region -> streamed call
        self.skipped: set[int] = set()            # regions calling an undeclared tool (SGLang)

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
        if not self.calls and len(c) > len(self.sent_content) and c.startswith(self.sent_content):
            # Hold back a possible start of "<tool_call>" split over tokens.
            safe = c if final else _hold_back(c, TOOL_START + "\n")
            if self.dialect.strips_text_before_tool_call and not final:
                safe = safe.rstrip()  # the text before a call is stripped: trailing space may vanish
            if len(safe) > len(self.sent_content):
                out.append({"content": safe[len(self.sent_content):]})
                self.sent_content = safe
        if self.tools_active:
            _, rest = self.dialect.split_reasoning(text, self.thinking)
            out += self._tool_deltas(rest, p.tool_calls if final else None)
        return out

    def _tool_deltas(self, rest: str, final_calls: list[ToolCallOut] | None) -> list[dict]:
        out = []
        d = self.dialect
        for r, (body, _closed) in enumerate(tool_regions(rest, d.tool_start, d.tool_end)):
            if r in self.skipped:
                continue
            if r >= len(self.scanners):
                self.scanners.append(JsonScanner())
            outer = self.scanners[r]
            outer.feed(body.lstrip())
            call = self.calls.get(r)
            fresh = call is None
            if fresh:
                name = outer.members.get("name")
                if name is None or name.string is None:
                    break  # call r+1 cannot start before call r is named (like the real parsers)
                if d.skips_undeclared_tools and self.tool_names is not None and name.string not in self.tool_names:
                    self.skipped.add(r)
                    continue
                call = self.calls[r] = _CallStream(len(self.calls), d.tool_call_id())
                out.append({"tool_call": {"index": call.index, "id": call.id, "name": name.string}})
            certain = certain_arguments(outer, body.lstrip(), call.args)
            raw = None
            if d.streams_raw_arguments:
                # vLLM 0.32 (checked against the real server): the arguments value's raw text as the
                # tokens bring it, trailing whitespace held back until more text follows.
                m = outer.members.get("arguments")
                raw = "" if m is None else body.lstrip()[m.start:m.end]
                if raw.startswith("{") and final_calls is None:
                    certain = raw if m.end is not None else raw.rstrip()
            if final_calls is not None:
                final = final_calls[call.index].arguments if call.index < len(final_calls) else None
                if raw is not None and raw.startswith("{") and raw.startswith(call.sent):
                    certain = raw  # the rest of the raw text (the non-stream answer re-serializes it)
                else:
                    certain = final if final is not None and final.startswith(call.sent) else call.sent
            elif d.lags_streamed_arguments and not outer.done:
                # SGLang sends what the previous and the current partial parse agree on, and only
                # once the previous parse had non-empty arguments (its `elif prev_arguments:`).
                prev = call.lag
                call.lag = None if fresh else certain
                certain = "" if fresh or prev in (None, "", "{", "[") else prev
            if len(certain) > len(call.sent) and certain.startswith(call.sent):
                out.append({"tool_call": {"index": call.index, "arguments": certain[len(call.sent):]}})
                call.sent = certain
        return out


def _hold_back(text: str, tag: str) -> str:
    for k in range(min(len(tag), len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text
