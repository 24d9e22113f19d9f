"""Shared pieces of the Responses and Messages translators (sans-IO: dicts and bytes only).

The translators turn a harness request into a plain chat-completions body and the upstream
chat-completions answer (one dict, or a sequence of parsed SSE chunks) back into the API the
harness spoke. This module holds what both share: the error type, id minting, SSE framing, the
request field rules, a reader that reduces upstream chunks to a few semantic steps, and
``ChatTranslator``, the base class with the outline both follow (request checks, upstream
errors, the stream's life: start, steps, upstream error chunk, abort, end).
"""
from __future__ import annotations

import base64
import binascii
import itertools
import json
import os
from collections.abc import Mapping

import orjson

from polar_contracts.request_fields import lax_bool


class TranslationError(ValueError):
    """The harness request cannot be expressed as a chat completion; the message says why."""


# Ids only need to be unique within a proxy run and recognisable; a per-process random stem plus a
# counter is cheap and easy to follow in logs and tests.
_STEM = os.urandom(6).hex()
_COUNTER = itertools.count(1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{_STEM}{next(_COUNTER):012x}"


def dumps(obj) -> bytes:
    return orjson.dumps(obj)


def sse(event: str, data: dict) -> bytes:
    """One named SSE event (both APIs name every event and repeat the name as data.type)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


# Exact reasoning text carried through an API's opaque field (Responses' encrypted_content, Gemini's
# thoughtSignature): harnesses resend that field untouched but not always the reasoning itself, and
# the template must see the reasoning the model sampled again for the next prompt to extend it.
ENC_PREFIX = "polar:v1:"


def encode_reasoning(text: str) -> str:
    return ENC_PREFIX + base64.b64encode(text.encode()).decode()


def decode_reasoning(blob) -> str | None:
    """The reasoning text of a blob encode_reasoning made; None for anything else (someone else's)."""
    if not isinstance(blob, str) or not blob.startswith(ENC_PREFIX):
        return None
    try:
        return base64.b64decode(blob[len(ENC_PREFIX):], validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def join_notes(notes: list[str], note: str) -> None:
    """Append a note once (a translator records each normalization a single time per call)."""
    if note not in notes:
        notes.append(note)


def tool_arguments(arguments, notes: list[str]) -> dict:
    """A chat tool call's `arguments` (a JSON string) as the object the Messages / Gemini APIs carry;
    text that is not a JSON object is kept, wrapped, with a note (never dropped)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        join_notes(notes, "tool call arguments were not valid JSON (passed as {\"_raw\": ...})")
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_value": value}


# reasoning_effort values both servers' chat endpoints accept (SGLang: low/medium/high only).
CHAT_EFFORTS = ("low", "medium", "high")


def reasoning_effort(effort, chat: dict, notes: list[str]) -> None:
    if effort is None:
        return
    if effort in CHAT_EFFORTS:
        chat["reasoning_effort"] = effort
    else:
        join_notes(notes, f"reasoning effort {effort!r} not forwarded (chat accepts low/medium/high)")


def stream_options(chat: dict, stream: bool) -> None:
    """Streaming chat requests ask for the usage chunk: both harnesses expect token counts."""
    stream = lax_bool(stream) is True  # (as the chat servers read "true" or 1)
    chat["stream"] = stream
    if stream:
        chat["stream_options"] = {"include_usage": True}


def copy_set_fields(body: dict, chat: dict, keys: tuple[str, ...]) -> None:
    """The request fields with the same name and meaning in chat, when set (not null)."""
    for key in keys:
        if body.get(key) is not None:
            chat[key] = body[key]


def function_tool(name, description, parameters, strict) -> dict:
    """A chat function tool (no parameters: an object schema without properties)."""
    fn = {"name": name, "description": description,
          "parameters": parameters or {"type": "object", "properties": {}}}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def forced_tool(name) -> dict:
    """The chat tool_choice that makes the model call the function ``name``."""
    return {"type": "function", "function": {"name": name}}


def first_choice(chat_resp: dict) -> tuple[dict, dict]:
    """Choice 0 of a non-streaming chat answer and its message (neither API has several)."""
    choice = (chat_resp.get("choices") or [{}])[0]
    return choice, choice.get("message") or {}


def prompt_len(chat_resp: dict) -> int | None:
    """How many prompt ids a non-streaming chat answer carries (top level, else on choice 0)."""
    ids = chat_resp.get("prompt_token_ids")
    if ids is None:
        ids = ((chat_resp.get("choices") or [{}])[0]).get("prompt_token_ids")
    return len(ids) if isinstance(ids, list) else None


def usage_counts(usage: dict | None, prompt_len: int | None) -> dict:
    """Token counts from a chat usage object (fallback: the prompt id count, if ids came back)."""
    usage = usage or {}
    prompt = usage.get("prompt_tokens")
    if prompt is None:
        prompt = prompt_len or 0
    completion = usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input": int(prompt), "output": int(completion), "cached": int(cached),
            "reasoning": int(reasoning)}


def message_reasoning(msg: dict) -> str | None:
    """vLLM answers with `reasoning`, SGLang with `reasoning_content`: accept both, prefer the latter."""
    r = msg.get("reasoning_content")
    if r is None:
        r = msg.get("reasoning")
    return r if isinstance(r, str) else None


def matched_stop(choice: dict):
    """The stop string that ended generation: vLLM says `stop_reason`, SGLang `matched_stop`."""
    s = choice.get("stop_reason")
    if s is None:
        s = choice.get("matched_stop")
    return s


def upstream_error_message(body: bytes) -> str:
    """The message of an upstream (vLLM / SGLang / proxy) error body, whatever its shape."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        text = body.decode("utf-8", "replace").strip()
        return text[:2000] or "upstream returned an empty error body"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if obj.get("message"):
            return str(obj["message"])
        if obj.get("detail"):
            return str(obj["detail"])
    return body.decode("utf-8", "replace")[:2000]


def chunk_error(chunk: dict) -> str | None:
    """vLLM and SGLang report a failure inside a running stream as a data object with `error`
    (or `object: "error"`) instead of a chunk; the translators turn it into the API's error."""
    if chunk.get("object") == "error" or "error" in chunk:
        err = chunk.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err or chunk.get("message") or "upstream error")
    return None


class ChatStreamReader:
    """Reduces upstream chat-completions chunks (choice 0) to steps the emitters understand:

    ("reasoning", text) | ("text", text) | ("tool_start", idx, upstream_id, name)
    | ("tool_args", idx, text). Usage, finish reason, matched stop and the prompt id count are
    kept as attributes. A tool call is started only once its name is known (Anthropic's
    content_block_start and Responses' output_item.added both need it); argument text that
    arrives before the name is held back and released with the start.
    """

    __slots__ = ("usage", "finish_reason", "stop", "prompt_len", "_tools", "_held")

    def __init__(self) -> None:
        self.usage: dict | None = None
        self.finish_reason: str | None = None
        self.stop = None
        self.prompt_len: int | None = None
        self._tools: dict[int, bool] = {}      # upstream tool index -> started
        self._held: dict[int, list] = {}       # index -> [id, name, args] before the name is known

    def read(self, chunk: dict) -> list[tuple]:
        usage = chunk.get("usage")
        if usage:
            self.usage = usage
        ids = chunk.get("prompt_token_ids")
        if isinstance(ids, list):
            self.prompt_len = len(ids)
        steps: list[tuple] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # neither API can return several choices; n > 1 is never requested
            delta = choice.get("delta") or {}
            reasoning = message_reasoning(delta)
            if reasoning:
                steps.append(("reasoning", reasoning))
            content = delta.get("content")
            if content:
                steps.append(("text", content))
            for call in delta.get("tool_calls") or ():
                self._tool_delta(call, steps)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop = matched_stop(choice)
        return steps

    def _tool_delta(self, call: dict, steps: list[tuple]) -> None:
        idx = call.get("index", 0)
        fn = call.get("function") or {}
        args = fn.get("arguments") or ""
        if self._tools.get(idx):
            if args:
                steps.append(("tool_args", idx, args))
            return
        held = self._held.setdefault(idx, [None, "", ""])
        held[0] = held[0] or call.get("id")
        held[1] = held[1] or fn.get("name") or ""
        held[2] += args
        if held[1]:
            self._tools[idx] = True
            del self._held[idx]
            steps.append(("tool_start", idx, held[0], held[1]))
            if held[2]:
                steps.append(("tool_args", idx, held[2]))

    def unfinished_tools(self) -> list[int]:
        """Tool calls whose name never arrived (reported, never silently dropped)."""
        return sorted(self._held)


class ChatTranslator:
    """The outline the Responses and Messages translators share (polar_contracts/translate/__init__.py
    lists the interface). A subclass sets ``api``, ``DROPPED`` (fields that only steer the vendor's own
    service: dropped, each noted) and ``KNOWN`` (every field it reads or drops; others are noted
    as unknown), and implements:

    ``_to_chat(body)``   the chat body for a request already checked to be an object
    ``error_body(status, message)``  the API's error shape
    ``_start(out)``      the stream's opening events (sets ``_started``)
    ``_step(step, out)`` the events of one ChatStreamReader step
    ``_end(out)``        the closing events after upstream [DONE]
    ``fail(message)``    the API's error event (also for an error chunk and an aborted generation)
    """

    api = ""
    DROPPED: tuple[str, ...] = ()
    KNOWN: frozenset[str] = frozenset()

    def __init__(self, normalize: bool = True) -> None:
        self.normalize = normalize
        self.notes: list[str] = []
        self.auxiliary = False
        self.metadata: dict | None = None
        self._reader = ChatStreamReader()
        self._started = False
        self._finished = False

    # ---- request ----
    def request_to_chat(self, body: dict, headers: Mapping[str, str] | None = None) -> dict:
        if not isinstance(body, dict):
            raise TranslationError("request body must be a JSON object")
        try:
            chat = self._to_chat(body)
        except (TypeError, AttributeError, KeyError, IndexError) as exc:
            # the translators read only the harness's body: a field of the wrong type or shape
            # (a tool that is not an object, text that is a list...) is the request's fault, a 400
            # in the API's own error shape (harnesses retry a 5xx)
            raise TranslationError(f"malformed request: a field has the wrong type or shape "
                                   f"({type(exc).__name__}: {exc})") from None
        for key in self.DROPPED:
            if key in body:
                join_notes(self.notes, f"dropped {key} (no chat equivalent)")
        for key in body.keys() - self.KNOWN:
            join_notes(self.notes, f"dropped unknown field {key}")
        stream_options(chat, body.get("stream", False))
        return chat

    def _to_chat(self, body: dict) -> dict:
        raise NotImplementedError

    def _auxiliary_if(self, json_schema: bool, tools: list) -> None:
        """A call asking for a JSON schema with no tools (the harness's session title and the
        like) is marked auxiliary: not agent trajectory."""
        if self.normalize and json_schema and not tools:
            self.auxiliary = True
            join_notes(self.notes, "auxiliary call (no tools, JSON output schema): not agent trajectory")

    # ---- errors ----
    def error_body(self, status: int, message: str) -> tuple[bytes, str]:
        raise NotImplementedError

    def error_from_chat(self, status: int, body: bytes) -> tuple[int, bytes, str]:
        data, ctype = self.error_body(status, upstream_error_message(body))
        return status, data, ctype

    # ---- streaming answer ----
    def feed_chunk(self, chunk: dict) -> bytes:
        if self._finished:
            return b""
        error = chunk_error(chunk)
        if error is not None:
            return self.fail(error)
        out: list[bytes] = []
        steps = self._reader.read(chunk)  # first: it may carry the prompt ids for the opening events
        if not self._started:
            self._start(out)
        for step in steps:
            self._step(step, out)
        return b"".join(out)

    def finish(self) -> bytes:
        if self._finished:
            return b""
        if self._reader.finish_reason == "abort":  # SGLang: the server gave up on the request
            return self.fail("upstream aborted the generation (finish_reason abort)")
        self._finished = True
        out: list[bytes] = []
        if not self._started:
            self._start(out)
        for idx in self._reader.unfinished_tools():
            join_notes(self.notes, f"upstream tool call {idx} never named its function (dropped)")
        self._end(out)
        return b"".join(out)

    def _start(self, out: list) -> None:
        raise NotImplementedError

    def _step(self, step: tuple, out: list) -> None:
        raise NotImplementedError

    def _end(self, out: list) -> None:
        raise NotImplementedError

    def fail(self, message: str) -> bytes:
        raise NotImplementedError
