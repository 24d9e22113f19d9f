"""Anthropic Messages API (Claude Code) <-> chat completions, sans-IO.

Request: system (string or text blocks) and inline `system` messages, user/assistant content
blocks (text, thinking, tool_use, tool_result), tools, tool_choice, thinking -> enable_thinking,
stop_sequences, sampling fields. Answer: an Anthropic `Message`, or the event stream
message_start, content_block_start/delta/stop (thinking, text, tool_use), message_delta,
message_stop. The mapping mirrors vLLM's own /v1/messages serving (entrypoints/anthropic) where
that is sensible: billing line stripped, system blocks joined with "", tool_use input as
json.dumps, tool_result text parts joined with "\n", stop reasons stop/length/tool_calls.
Differences: content is always flattened to strings (the Qwen3 template renders list content as
empty, and the two servers join parts differently), inline system messages stay in place
(vLLM's "preserve" mode; moved after the tool results they would split), and images are refused.
"""
from __future__ import annotations

import json

from polar_contracts.translate.common import (
    ChatTranslator,
    TranslationError,
    copy_set_fields,
    dumps,
    first_choice,
    forced_tool,
    function_tool,
    join_notes,
    matched_stop,
    message_reasoning,
    new_id,
    prompt_len,
    reasoning_effort,
    sse,
    tool_arguments,
    usage_counts,
)

BILLING_PREFIX = "x-anthropic-billing-header"
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               529: "overloaded_error"}
# Request fields with a direct chat equivalent (same name, same meaning).
PASS_THROUGH = ("temperature", "top_p", "top_k")
# Fields that only steer Anthropic's own service; dropped and recorded.
DROPPED = ("context_management", "service_tier", "container", "mcp_servers", "inference_geo")


def _text_of(blocks, where: str, notes: list[str]) -> str:
    """Join text blocks with "\n" (vLLM's join); anything else is refused with its type named."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for b in blocks or ():
        kind = b.get("type")
        if kind == "text":
            parts.append(b.get("text") or "")
            if "cache_control" in b:
                join_notes(notes, "cache_control dropped before templating")
        elif kind in ("image", "document"):
            raise TranslationError(
                f"{where}: {kind} blocks are not supported (the chat template is text-only)")
        else:
            raise TranslationError(f"{where}: unsupported content block type {kind!r}")
    return "\n".join(parts)


def _system_text(system, notes: list[str], normalize: bool) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        blocks = [{"type": "text", "text": system}]
    elif isinstance(system, list):
        blocks = system
    else:
        raise TranslationError("system must be a string or a list of text blocks")
    parts = []
    for b in blocks:
        if b.get("type") != "text":
            raise TranslationError(f"system: unsupported block type {b.get('type')!r}")
        text = b.get("text") or ""
        if normalize and text.startswith(BILLING_PREFIX):
            # Per-session hash line: it breaks prefix sharing across sessions (docs/reference.md, "What harnesses send back").
            # Only that line goes; text after it in the same block stays.
            join_notes(notes, "removed Claude Code x-anthropic-billing-header system line")
            text = text.split("\n", 1)[1] if "\n" in text else ""
            if not text:
                continue
        if "cache_control" in b:
            join_notes(notes, "cache_control dropped before templating")
        parts.append(text)
    return "".join(parts)  # vLLM joins system blocks without a separator


def _tool_result(block: dict, known: set[str], notes: list[str]) -> dict:
    tid = block.get("tool_use_id")
    if tid not in known:
        raise TranslationError(
            f"tool_result for tool_use_id {tid!r} has no matching tool_use in an earlier "
            "assistant message")
    if "cache_control" in block:
        join_notes(notes, "cache_control dropped before templating")
    if block.get("is_error"):
        # Chat has no error flag on tool messages; Claude Code already wraps the text of a
        # failed tool in <tool_use_error>, so the model still sees that it failed.
        join_notes(notes, "tool_result is_error has no chat equivalent (content kept as is)")
    content = _text_of(block.get("content") or "", f"tool_result {tid}", notes)
    return {"role": "tool", "tool_call_id": tid, "content": content}


def _user_messages(content, known: set[str], notes: list[str], i: int) -> list[dict]:
    """A user turn: tool results become tool messages, the rest one user message after them."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tools, rest = [], []
    for b in content or ():
        (tools if b.get("type") == "tool_result" else rest).append(b)
    out = [_tool_result(b, known, notes) for b in tools]
    if rest:
        out.append({"role": "user", "content": _text_of(rest, f"messages[{i}]", notes)})
    return out


def _assistant_message(content, known: set[str], notes: list[str], i: int) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, thinking, calls = [], [], []
    for b in content or ():
        kind = b.get("type")
        if kind == "text":
            texts.append(b.get("text") or "")
        elif kind == "thinking":
            thinking.append(b.get("thinking") or "")
        elif kind == "redacted_thinking":
            join_notes(notes, "redacted_thinking block dropped (opaque)")
        elif kind == "tool_use":
            known.add(b.get("id"))
            calls.append({"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name"),
                "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
        elif kind in ("image", "document"):
            raise TranslationError(f"messages[{i}]: {kind} blocks are not supported")
        else:
            raise TranslationError(f"messages[{i}]: unsupported content block type {kind!r}")
        if "cache_control" in b:
            join_notes(notes, "cache_control dropped before templating")
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if thinking:
        # Resent thinking goes back where the Qwen3 template looks for it.
        msg["reasoning_content"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _place_inline_system(messages: list[dict]) -> list[dict]:
    """Keep inline system messages in place, but never between tool calls and their results."""
    out, held = [], []
    for m in messages:
        if m["role"] == "system" and out and out[-1]["role"] in ("assistant", "tool") \
                and _awaiting_results(out):
            held.append(m)
            continue
        if held and m["role"] != "tool":
            out.extend(held)
            held.clear()
        out.append(m)
    out.extend(held)
    return out


def _awaiting_results(out: list[dict]) -> bool:
    """True while the last assistant turn's tool calls are not all answered."""
    answered = set()
    for m in reversed(out):
        if m["role"] == "tool":
            answered.add(m.get("tool_call_id"))
        elif m["role"] == "assistant":
            return any(c["id"] not in answered for c in m.get("tool_calls") or ())
        else:
            return False
    return False


def convert_messages(body: dict, notes: list[str], normalize: bool) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise TranslationError("messages must be a non-empty list")
    out: list[dict] = []
    system = _system_text(body.get("system"), notes, normalize)
    if system:
        out.append({"role": "system", "content": system})
    known: set[str] = set()
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out.extend(_user_messages(m.get("content"), known, notes, i))
        elif role == "assistant":
            out.append(_assistant_message(m.get("content"), known, notes, i))
        elif role == "system":
            text = _system_text(m.get("content"), notes, normalize)
            if text:
                join_notes(notes, "inline system message kept in place as a system turn")
                out.append({"role": "system", "content": text})
        else:
            raise TranslationError(f"messages[{i}]: unknown role {role!r}")
    return _place_inline_system(out)


def convert_tools(body: dict, notes: list[str]) -> list[dict]:
    tools = []
    for t in body.get("tools") or ():
        kind = t.get("type")
        if kind not in (None, "custom"):
            # Anthropic-defined tools (web_search_2025..., bash_2025..., ...) run on Anthropic's side.
            join_notes(notes, f"dropped Anthropic server tool {t.get('name')!r} ({kind})")
            continue
        if "cache_control" in t:
            join_notes(notes, "cache_control dropped before templating")
        tools.append(function_tool(t.get("name"), t.get("description", ""), t.get("input_schema"),
                                   t.get("strict")))
    return tools


def convert_tool_choice(choice, chat: dict) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool":
        chat["tool_choice"] = forced_tool(choice.get("name"))
    else:
        raise TranslationError(f"tool_choice: unknown type {kind!r}")
    if choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False


def _json_schema(body: dict):
    fmt = (body.get("output_config") or {}).get("format") or body.get("output_format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return fmt.get("schema") or fmt.get("json_schema")
    return None


class MessagesTranslator(ChatTranslator):
    api = "messages"
    DROPPED = DROPPED
    KNOWN = frozenset({"model", "messages", "system", "max_tokens", "tools", "tool_choice", "stop_sequences",
                       "stream", "thinking", "metadata", "output_config", "output_format", *PASS_THROUGH,
                       *DROPPED})

    def __init__(self, normalize: bool = True) -> None:
        super().__init__(normalize)
        self.model = ""
        self.stop_sequences: list[str] = []
        self._block = -1            # index of the open content block, -1 when none
        self._kind = ""             # kind of the open block: thinking | text | tool
        self._prefix = b""          # SSE bytes before the delta text of the open block
        self._tool_blocks: dict[int, int] = {}  # upstream tool index -> content block index
        self._msg_id = new_id("msg")

    # ---- request ----
    def _to_chat(self, body: dict) -> dict:
        notes = self.notes
        self.model = body.get("model") or ""
        chat: dict = {"model": self.model,
                      "messages": convert_messages(body, notes, self.normalize)}
        if body.get("max_tokens") is None:
            raise TranslationError("max_tokens is required")
        chat["max_tokens"] = body["max_tokens"]
        tools = convert_tools(body, notes)
        if tools:
            chat["tools"] = tools
        convert_tool_choice(body.get("tool_choice"), chat)
        stops = body.get("stop_sequences")
        if stops:
            self.stop_sequences = list(stops)
            chat["stop"] = self.stop_sequences
        copy_set_fields(body, chat, PASS_THROUGH)
        self._thinking(body, chat)
        if chat["messages"][-1]["role"] == "assistant":
            # Anthropic prefill: the answer continues the last assistant turn.
            chat["continue_final_message"] = True
            chat["add_generation_prompt"] = False
            join_notes(notes, "assistant prefill sent as continue_final_message")
        schema = _json_schema(body)
        if schema is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema}}
        self._auxiliary_if(schema is not None, tools)  # Claude Code's session-title call
        if "metadata" in body:
            self.metadata = body.get("metadata")
            join_notes(notes, "metadata recorded, not forwarded")
        return chat

    def _thinking(self, body: dict, chat: dict) -> None:
        thinking = body.get("thinking")
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind in ("enabled", "adaptive"):
            enable = True
            if thinking.get("budget_tokens") is not None:
                join_notes(self.notes, "thinking.budget_tokens dropped (no chat equivalent)")
        elif kind == "disabled" or thinking is None:
            enable = False  # the Messages API thinks only when asked to
        else:
            raise TranslationError(f"thinking: unknown type {kind!r}")
        chat["chat_template_kwargs"] = {"enable_thinking": enable}
        effort = (body.get("output_config") or {}).get("effort")
        reasoning_effort(effort, chat, self.notes)  # as vLLM's own /v1/messages does

    # ---- errors ----
    def error_body(self, status: int, message: str) -> tuple[bytes, str]:
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return dumps({"type": "error", "error": {"type": kind, "message": message}}), \
            "application/json"

    # ---- non-streaming answer ----
    def response_from_chat(self, chat_resp: dict) -> dict:
        choice, msg = first_choice(chat_resp)
        content: list[dict] = []
        reasoning = message_reasoning(msg)
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning,
                            "signature": self._signature()})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            content.append({"type": "tool_use", "id": new_id("toolu"), "name": fn.get("name"),
                            "input": tool_arguments(fn.get("arguments"), self.notes)})
        counts = usage_counts(chat_resp.get("usage"), prompt_len(chat_resp))
        reason, stop_seq = self._stop(choice.get("finish_reason"), matched_stop(choice),
                                      bool(msg.get("tool_calls")))
        return {"id": self._msg_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": stop_seq,
                "usage": self._usage(counts)}

    def _stop(self, finish: str | None, stop, called: bool = False) -> tuple[str, str | None]:
        if finish == "stop" and isinstance(stop, str) and stop in self.stop_sequences:
            return "stop_sequence", stop
        if finish in (None, "stop") and called:
            return "tool_use", None  # Claude Code runs tools only on stop_reason tool_use
        return STOP_REASONS.get(finish or "stop", "end_turn"), None

    @staticmethod
    def _usage(counts: dict) -> dict:
        return {"input_tokens": counts["input"], "output_tokens": counts["output"],
                "cache_read_input_tokens": counts["cached"], "cache_creation_input_tokens": 0}

    def _signature(self) -> str:
        # Claude Code resends thinking blocks with their signature; the text itself goes back to
        # the template, so the signature only has to be present and recognisable.
        return "polar-unsigned-" + self._msg_id

    # ---- streaming answer (ChatTranslator.feed_chunk / finish) ----
    def _start(self, out: list) -> None:
        self._started = True
        counts = usage_counts(self._reader.usage, self._reader.prompt_len)
        usage = self._usage(counts)
        usage["output_tokens"] = 0
        out.append(sse("message_start", {"type": "message_start", "message": {
            "id": self._msg_id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}))

    def _step(self, step: tuple, out: list) -> None:
        kind = step[0]
        if kind == "reasoning":
            if self._kind != "thinking":
                self._open(out, "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._prefix + dumps(step[1]) + b"}}\n\n")
        elif kind == "text":
            if self._kind != "text":
                self._open(out, "text", {"type": "text", "text": ""})
            out.append(self._prefix + dumps(step[1]) + b"}}\n\n")
        elif kind == "tool_start":
            self._open(out, "tool", {"type": "tool_use", "id": new_id("toolu"), "name": step[3],
                                     "input": {}})
            self._tool_blocks[step[1]] = self._block
        elif kind == "tool_args":
            index = self._tool_blocks[step[1]]
            out.append(sse("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": step[2]}}))

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta",
                   {"type": "content_block_delta", "index": self._block, "delta": delta})

    def _open(self, out: list, kind: str, block: dict) -> None:
        self._close(out)
        self._block += 1
        self._kind = kind
        # Text and thinking deltas are most of a stream: frame them from a per-block prefix.
        field = "thinking" if kind == "thinking" else "text"
        self._prefix = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                        + str(self._block).encode() + b',"delta":{"type":"' + field.encode()
                        + b'_delta","' + field.encode() + b'":')
        out.append(sse("content_block_start", {"type": "content_block_start",
                                               "index": self._block, "content_block": block}))

    def _close(self, out: list) -> None:
        if not self._kind:
            return
        if self._kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": self._signature()}))
        out.append(sse("content_block_stop", {"type": "content_block_stop", "index": self._block}))
        self._kind = ""

    def _end(self, out: list) -> None:
        self._close(out)
        reason, stop_seq = self._stop(self._reader.finish_reason, self._reader.stop,
                                      bool(self._tool_blocks))
        counts = usage_counts(self._reader.usage, self._reader.prompt_len)
        out.append(sse("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": reason, "stop_sequence": stop_seq},
                                         "usage": self._usage(counts)}))
        out.append(sse("message_stop", {"type": "message_stop"}))

    def fail(self, message: str) -> bytes:
        self._finished = True
        return sse("error", {"type": "error", "error": {"type": "api_error", "message": message}})

