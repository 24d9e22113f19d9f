"""OpenAI Responses API (Codex CLI) <-> chat completions, sans-IO.

Request: instructions and developer/system messages -> system messages, input items (message,
reasoning, function_call, function_call_output) -> chat messages, where the items of one
assistant turn (reasoning, message, function calls) become ONE assistant message with
`reasoning_content` and `tool_calls` (as vLLM's construct_chat_messages_with_tool_call does);
function tools (also those grouped in a `namespace` tool) -> chat tools; hosted tools dropped.
Answer: a `Response`, or the event stream response.created / in_progress, output_item.added,
content_part.added, output_text.delta / reasoning_text.delta / function_call_arguments.delta,
the matching .done events, output_item.done, and response.completed (response.incomplete when
the token limit cut the answer, response.failed on an upstream failure).

Reasoning round trip: the Responses API does not send raw reasoning back on its own (Codex
resends reasoning items with `summary` and `encrypted_content` only), so the exact reasoning
text is put into `encrypted_content` ("polar:v1:" + base64) when the client asks for it; a
resent item decodes back to the exact text the model sampled, so the template sees it again.
Items carrying someone else's encrypted_content fall back to content, then summary text.

Refused with a TranslationError naming the item: image/file/audio parts (the template is
text-only), item_reference and previous_response_id (the proxy keeps no response state), a
function_call_output without its function_call, and input item types with no chat meaning
(custom_tool_call, local_shell_call, computer_call, ...). Hosted and custom tools are dropped
(noted); Codex 0.171 sent neither for a non-OpenAI provider.
"""
from __future__ import annotations

import time

from polar_contracts.translate.common import (  # noqa: F401 - ENC_PREFIX, decode_reasoning re-exported
    ENC_PREFIX,
    ChatTranslator,
    TranslationError,
    copy_set_fields,
    decode_reasoning,
    dumps,
    encode_reasoning,
    first_choice,
    forced_tool,
    function_tool,
    join_notes,
    message_reasoning,
    new_id,
    prompt_len,
    reasoning_effort,
    sse,
    usage_counts,
)

PASS_THROUGH = ("temperature", "top_p", "parallel_tool_calls", "user")
# Fields that steer OpenAI's own service (state, caching, tracing) and have no chat meaning here.
DROPPED = ("store", "include", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
           "service_tier", "truncation", "background", "top_logprobs", "max_tool_calls",
           "prompt_cache_options", "stream_options")
# Recorded on the row (translator.metadata), not forwarded.
METADATA = ("metadata", "client_metadata")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _parts_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for p in content or ():
        kind = p.get("type")
        if kind in TEXT_PARTS:
            parts.append(p.get("text") or "")
        elif kind == "refusal":
            parts.append(p.get("refusal") or "")
        elif kind in ("input_image", "input_file", "input_audio"):
            raise TranslationError(f"{where}: {kind} parts are not supported (text-only template)")
        else:
            raise TranslationError(f"{where}: unsupported content part type {kind!r}")
    return "\n".join(parts)


def _reasoning_text(item: dict, notes: list[str]) -> str:
    exact = decode_reasoning(item.get("encrypted_content"))
    if exact is not None:
        return exact
    content = item.get("content") or []
    if content:
        return "".join(p.get("text") or "" for p in content)
    summary = item.get("summary") or []
    if summary:
        join_notes(notes, "reasoning item without our encrypted_content: its summary text used")
    return "\n\n".join(p.get("text") or "" for p in summary)


class _History:
    """Builds chat messages from input items; one open assistant message collects a turn."""

    def __init__(self, notes: list[str]) -> None:
        self.notes = notes
        self.out: list[dict] = []
        self.turn: dict | None = None
        self.calls: set[str] = set()

    def close(self) -> None:
        if self.turn is not None:
            self.turn.setdefault("content", "")
            self.out.append(self.turn)
            self.turn = None

    def assistant(self, start_new_if: tuple[str, ...]) -> dict:
        if self.turn is not None and any(k in self.turn for k in start_new_if):
            self.close()
        if self.turn is None:
            self.turn = {"role": "assistant"}
        return self.turn

    def add(self, item: dict, i: int) -> None:
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            self._message(item, i)
        elif kind == "reasoning":
            turn = self.assistant(("reasoning_content", "content", "tool_calls"))
            turn["reasoning_content"] = _reasoning_text(item, self.notes)
        elif kind == "function_call":
            turn = self.assistant(())
            self.calls.add(item.get("call_id"))
            turn.setdefault("tool_calls", []).append({
                "id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if cid not in self.calls:
                raise TranslationError(f"input[{i}]: function_call_output for call_id {cid!r} "
                                       "has no matching function_call item before it")
            self.close()
            self.out.append({"role": "tool", "tool_call_id": cid,
                             "content": _parts_text(item.get("output"), f"input[{i}].output")})
        elif kind == "item_reference":
            raise TranslationError(f"input[{i}]: item_reference needs server-side state, which "
                                   "the proxy does not keep (send the items themselves)")
        else:
            raise TranslationError(f"input[{i}]: unsupported input item type {kind!r}")

    def _message(self, item: dict, i: int) -> None:
        role = item.get("role")
        text = _parts_text(item.get("content"), f"input[{i}].content")
        if role == "assistant":
            turn = self.assistant(("content", "tool_calls"))
            turn["content"] = text
            return
        self.close()
        if role == "developer":
            # The Qwen3 template renders no `developer` role (the message would vanish).
            join_notes(self.notes, "developer messages sent as system messages")
            role = "system"
        elif role not in ("user", "system"):
            raise TranslationError(f"input[{i}]: unknown message role {role!r}")
        self.out.append({"role": role, "content": text})


def convert_input(body: dict, notes: list[str]) -> list[dict]:
    history = _History(notes)
    instructions = body.get("instructions")
    if instructions:
        history.out.append({"role": "system", "content": _parts_text(instructions, "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise TranslationError("input must be a non-empty string or list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TranslationError(f"input[{i}] must be an object")
        history.add(item, i)
    history.close()
    return history.out


def _function_tool(t: dict) -> dict:
    return function_tool(t.get("name"), t.get("description") or "", t.get("parameters"), t.get("strict"))


def convert_tools(body: dict, notes: list[str], namespaces: dict[str, str]) -> list[dict]:
    tools = []
    for t in body.get("tools") or ():
        kind = t.get("type")
        if kind == "function":
            tools.append(_function_tool(t))
        elif kind == "namespace":
            # Flattened: the model calls the inner name; the answer's function_call gets the
            # namespace back so Codex routes it.
            join_notes(notes, f"namespace tool {t.get('name')!r} flattened into its functions")
            for inner in t.get("tools") or ():
                if inner.get("type") == "function":
                    namespaces[inner.get("name")] = t.get("name")
                    tools.append(_function_tool(inner))
                else:
                    join_notes(notes, f"dropped {inner.get('type')} tool in namespace {t.get('name')!r}")
        else:
            join_notes(notes, f"dropped hosted/non-function tool {kind!r} (no chat equivalent)")
    return tools


def convert_tool_choice(choice, chat: dict, notes: list[str]) -> None:
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = forced_tool(choice.get("name"))
    elif isinstance(choice, dict):
        join_notes(notes, f"tool_choice {choice.get('type')!r} dropped (no chat equivalent)")
    else:
        raise TranslationError(f"tool_choice: unsupported value {choice!r}")


def convert_text_format(body: dict, chat: dict, notes: list[str]):
    text = body.get("text") or {}
    fmt = text.get("format") or {}
    if text.get("verbosity") is not None:
        join_notes(notes, "text.verbosity dropped (no chat equivalent)")
    kind = fmt.get("type")
    if kind == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name") or "output", "schema": fmt.get("schema") or {},
            **({"strict": fmt["strict"]} if fmt.get("strict") is not None else {})}}
    elif kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    return kind


class ResponsesTranslator(ChatTranslator):
    api = "responses"
    DROPPED = DROPPED
    KNOWN = frozenset({"model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "reasoning",
                       "text", "stream", "previous_response_id", *PASS_THROUGH, *DROPPED, *METADATA})

    def __init__(self, normalize: bool = True) -> None:
        super().__init__(normalize)
        self.request: dict = {}
        self.namespaces: dict[str, str] = {}
        self.send_encrypted = False
        self._resp_id = new_id("resp")
        self._created = int(time.time())
        self._seq = 0
        self._output: list[dict] = []      # finished output items, in order
        self._open: dict | None = None     # the open reasoning / message item
        self._open_text: list[str] = []
        self._prefix = b""                 # SSE bytes before the delta text of the open item
        self._calls: dict[int, dict] = {}  # upstream tool index -> open function_call item

    # ---- request ----
    def _to_chat(self, body: dict) -> dict:
        if body.get("previous_response_id"):
            raise TranslationError("previous_response_id is not supported: the proxy keeps no "
                                   "response state (send the full input, store=false)")
        notes = self.notes
        self.request = body
        chat: dict = {"model": body.get("model") or "", "messages": convert_input(body, notes)}
        tools = convert_tools(body, notes, self.namespaces)
        if tools:
            chat["tools"] = tools
        convert_tool_choice(body.get("tool_choice"), chat, notes)
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        copy_set_fields(body, chat, PASS_THROUGH)
        self._reasoning(body, chat)
        fmt = convert_text_format(body, chat, notes)
        self._auxiliary_if(fmt == "json_schema", tools)
        self.send_encrypted = "reasoning.encrypted_content" in (body.get("include") or ())
        if any(body.get(k) is not None for k in METADATA):
            self.metadata = {k: body[k] for k in METADATA if k in body}
            join_notes(notes, "metadata recorded, not forwarded")
        return chat

    def _reasoning(self, body: dict, chat: dict) -> None:
        reasoning = body.get("reasoning")
        if not isinstance(reasoning, dict):
            return  # model default
        effort = reasoning.get("effort")
        if effort is not None:
            reasoning_effort(effort, chat, self.notes)
            chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
        if reasoning.get("summary") not in (None, "auto"):
            join_notes(self.notes, "reasoning.summary ignored: reasoning is returned as raw text")

    # ---- errors ----
    def error_body(self, status: int, message: str) -> tuple[bytes, str]:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return dumps({"error": {"message": message, "type": kind, "param": None,
                                "code": None}}), "application/json"

    # ---- shared response object ----
    def _response(self, status: str, output: list[dict], usage: dict | None = None,
                  error: dict | None = None, incomplete: dict | None = None) -> dict:
        req = self.request
        return {
            "id": self._resp_id, "object": "response", "created_at": self._created,
            "status": status, "model": req.get("model") or "", "output": output,
            "error": error, "incomplete_details": incomplete,
            "instructions": req.get("instructions"), "metadata": req.get("metadata") or {},
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "temperature": req.get("temperature"), "top_p": req.get("top_p"),
            "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools") or [],
            "max_output_tokens": req.get("max_output_tokens"), "reasoning": req.get("reasoning"),
            "store": False, "usage": usage,
        }

    def _usage(self) -> dict:
        c = usage_counts(self._reader.usage, self._reader.prompt_len)
        return {"input_tokens": c["input"],
                "input_tokens_details": {"cached_tokens": c["cached"], "cache_write_tokens": 0},
                "output_tokens": c["output"],
                "output_tokens_details": {"reasoning_tokens": c["reasoning"]},
                "total_tokens": c["input"] + c["output"]}

    def _terminal(self, finish: str | None) -> tuple[str, dict | None]:
        if finish == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        if finish == "content_filter":
            return "incomplete", {"reason": "content_filter"}
        return "completed", None

    def _reasoning_item(self, text: str, status: str = "completed") -> dict:
        item = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": status}
        if self.send_encrypted:
            item["encrypted_content"] = encode_reasoning(text)
        return item

    def _call_item(self, name: str, arguments: str, status: str = "completed") -> dict:
        item = {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"),
                "name": name, "arguments": arguments, "status": status}
        if name in self.namespaces:
            item["namespace"] = self.namespaces[name]
        return item

    # ---- non-streaming answer ----
    def response_from_chat(self, chat_resp: dict) -> dict:
        choice, msg = first_choice(chat_resp)
        self._reader.usage = chat_resp.get("usage")
        self._reader.prompt_len = prompt_len(chat_resp)
        output = []
        reasoning = message_reasoning(msg)
        if reasoning:
            output.append(self._reasoning_item(reasoning))
        if msg.get("content"):
            output.append({"type": "message", "id": new_id("msg"), "role": "assistant",
                           "status": "completed", "content": [
                               {"type": "output_text", "text": msg["content"],
                                "annotations": [], "logprobs": []}]})
        for call in msg.get("tool_calls") or ():
            fn = call.get("function") or {}
            output.append(self._call_item(fn.get("name"), fn.get("arguments") or "{}"))
        status, incomplete = self._terminal(choice.get("finish_reason"))
        return self._response(status, output, self._usage(), incomplete=incomplete)

    # ---- streaming answer (ChatTranslator.feed_chunk / finish) ----
    def _ev(self, kind: str, fields: dict) -> bytes:
        fields["type"] = kind
        fields["sequence_number"] = self._seq
        self._seq += 1
        return sse(kind, fields)

    def _start(self, out: list) -> None:
        self._started = True
        snapshot = self._response("in_progress", [])
        out.append(self._ev("response.created", {"response": snapshot}))
        out.append(self._ev("response.in_progress", {"response": snapshot}))

    def _step(self, step: tuple, out: list) -> None:
        kind = step[0]
        if kind == "reasoning" or kind == "text":
            want = "reasoning" if kind == "reasoning" else "message"
            if self._open is None or self._open["type"] != want:
                self._open_item(want, out)
            self._open_text.append(step[1])
            out.append(self._prefix + dumps(step[1]) + b',"sequence_number":'
                       + str(self._seq).encode() + b"}\n\n")
            self._seq += 1
        elif kind == "tool_start":
            self._close_open(out)
            item = self._call_item(step[3], "", status="in_progress")
            self._calls[step[1]] = item
            self._output.append(item)
            out.append(self._ev("response.output_item.added",
                                {"output_index": self._index(item), "item": dict(item)}))
        elif kind == "tool_args":
            item = self._calls[step[1]]
            item["arguments"] += step[2]
            out.append(self._ev("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": self._index(item), "delta": step[2]}))

    def _index(self, item: dict) -> int:
        # Items are appended when they open, so an item's output index never changes.
        for i in range(len(self._output) - 1, -1, -1):
            if self._output[i] is item:
                return i
        raise KeyError(item["id"])

    def _open_item(self, kind: str, out: list) -> None:
        self._close_open(out)
        self._close_calls(out)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": new_id("msg"), "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open, self._open_text = item, []
        self._output.append(item)
        idx = self._index(item)
        # Text deltas are most of a stream: frame them from a per-item prefix (same fields as
        # ResponseTextDeltaEvent / ResponseReasoningTextDeltaEvent).
        ev = b"response.reasoning_text.delta" if kind == "reasoning" else \
            b"response.output_text.delta"
        self._prefix = (b"event: " + ev + b'\ndata: {"type":"' + ev + b'","item_id":"'
                        + item["id"].encode() + b'","output_index":' + str(idx).encode()
                        + b',"content_index":0,' + (b'"logprobs":[],' if kind != "reasoning"
                                                   else b"") + b'"delta":')
        out.append(self._ev("response.output_item.added", {"output_index": idx, "item": dict(item)}))
        out.append(self._ev("response.content_part.added", {
            "item_id": item["id"], "output_index": idx, "content_index": 0, "part": part}))

    def _close_open(self, out: list, status: str = "completed") -> None:
        item = self._open
        if item is None:
            return
        self._open = None
        text = "".join(self._open_text)
        idx = self._index(item)
        base = {"item_id": item["id"], "output_index": idx, "content_index": 0}
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self._ev("response.reasoning_text.done", {**base, "text": text}))
            if self.send_encrypted:
                item["encrypted_content"] = encode_reasoning(text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._ev("response.output_text.done", {**base, "text": text,
                                                              "logprobs": []}))
        out.append(self._ev("response.content_part.done", {**base, "part": part}))
        item["content"] = [part]
        item["status"] = status
        out.append(self._ev("response.output_item.done", {"output_index": idx, "item": item}))

    def _close_calls(self, out: list, status: str = "completed") -> None:
        for item in self._calls.values():
            idx = self._index(item)
            out.append(self._ev("response.function_call_arguments.done", {
                "item_id": item["id"], "output_index": idx, "name": item["name"],
                "arguments": item["arguments"]}))
            item["status"] = status
            out.append(self._ev("response.output_item.done", {"output_index": idx, "item": item}))
        self._calls = {}

    def _end(self, out: list) -> None:
        status, incomplete = self._terminal(self._reader.finish_reason)
        item_status = "incomplete" if status == "incomplete" else "completed"
        self._close_open(out, item_status)
        self._close_calls(out, item_status)
        event = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._ev(event, {"response": self._response(
            status, self._output, self._usage(), incomplete=incomplete)}))

    def fail(self, message: str) -> bytes:
        self._finished = True
        out: list[bytes] = []
        if not self._started:
            self._start(out)
        out.append(self._ev("response.failed", {"response": self._response(
            "failed", self._output, self._usage(),
            error={"code": "server_error", "message": message})}))
        return b"".join(out)
