"""Streaming response transforms (sans-IO): bytes from the server in, bytes for the harness out,
event by event as they arrive (never buffering the stream).

``StreamFilter`` (chat and completions): events the proxy did not touch pass through with their
exact bytes; an event that carried added fields is re-serialized without them; an event that only
exists because of the proxy's flags (SGLang's sglext chunk) is dropped. ``TranslatedStream`` feeds
the same parsed chunks to a Responses/Messages translator instead.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable

import orjson

from addon.assemble import Assembler
from addon.server_dialects import strip_response
from polar_contracts.translate.common import ChatTranslator

from .call_tokens import CallTokens, ExtractFn
from .idlists import MIN_BYTES, PromptCache
from .json_style import (
    COMPACT_UTF8,
    dumps_faithful,
    dumps_fast,
    dumps_like_python,
    dumps_like_safe,
    dumps_stripped,
    has_escapes,
    json_style,
)
from .sse import Event, SSEParser

_DATA_LINE = re.compile(rb"(?:\A|(?<=[\r\n]))data:(?: )?")


def serialize_event(ev: Event, data: bytes) -> bytes:
    """The event with its data replaced: every other line (``id:``, ``event:``, ``retry:``,
    comments) and the line endings as the server wrote them."""
    raw = ev.raw
    if raw.startswith(b"data: ") and len(raw) == len(ev.data_bytes or b"") + 8:  # the common event
        return b"data: " + data + raw[-2:]
    starts = list(_DATA_LINE.finditer(raw))
    if len(starts) == 1:  # one data line: replace its value in place
        lo = starts[0].end()
        hi = lo + len(ev.data_bytes or b"")
        return raw[:lo] + data + raw[hi:]
    nl = ev.newline  # (several data lines: the data is one line now, the other fields kept)
    head = b"event: " + ev.event.encode() + nl if ev.event is not None else b""
    return head + b"data: " + data + nl + nl


def error_event(message: str, status: int = 503, newline: bytes = b"\n") -> bytes:
    """A chat/completions stream's error event (as vLLM sends one mid-stream: ``data: {"error"}``)."""
    body = {"error": {"message": message, "type": "polar_proxy_error", "code": status}}
    return b"data: " + orjson.dumps(body) + newline + newline


class _Base:
    def __init__(self, cap: CallTokens, extract: ExtractFn):
        self.cap = cap
        self.extract = extract
        self.parser = SSEParser()
        self.saw_done = False
        self.saw_data = False
        self.closed = False
        self.prompt_cache: PromptCache | None = None  # (idlists.py) for the big first chunk (vLLM prompt ids)
        self.cache_key = ""
        # called at the stream's final event ([DONE]) before it goes to the harness: the proxy
        # writes the row there (a kill after the harness saw [DONE] must not lose the call);
        # returns None, or why the call could not be recorded (the harness then gets an error)
        self.on_final: Callable[[], str | None] | None = None
        self.final_error: str | None = None

    def _final(self) -> str | None:
        cb, self.on_final = self.on_final, None
        if cb is None:
            return None
        try:
            self.final_error = cb()
        except Exception as exc:  # noqa: BLE001 - the call is not recorded: say so, never pass [DONE]
            self.final_error = f"polar proxy could not record this call: {type(exc).__name__}: {exc}"
        return self.final_error

    def _parse(self, ev: Event) -> object:
        data = ev.data_bytes
        try:
            if self.prompt_cache is not None and len(data) >= MIN_BYTES:
                return self.prompt_cache.loads(self.cache_key, data)
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            try:  # valid JSON orjson refuses (a lone surrogate escape): the json module reads it
                return json.loads(data)
            except (ValueError, UnicodeDecodeError):
                pass
            self.cap.errors.append(f"a stream event could not be parsed ({exc}) and passed through "
                                   f"unchanged: the row may miss tokens")
            return None

    def __call__(self, data: bytes) -> list[bytes]:
        """mitmproxy's ``flow.response.stream`` callable: b"" marks the end of the stream.
        Returns a list: an empty bytes chunk would be sent as HTTP/1's end-of-body marker."""
        out = self.close() if data == b"" else self.feed(data)
        return [out] if out else []

    def feed(self, data: bytes) -> bytes:
        events = self.parser.feed(data)
        if not events:
            return b""
        if len(events) == 1:
            return self._safe_event(events[0])
        return b"".join(self._safe_event(ev) for ev in events)

    def _safe_event(self, ev: Event) -> bytes:
        """A bug or an odd event must never break the harness's stream: pass it through as is."""
        try:
            return self._event(ev)
        except Exception as exc:  # noqa: BLE001
            self.cap.errors.append(f"a stream event could not be processed ({type(exc).__name__}: {exc}): "
                                   f"the row may miss tokens")
            return self._fallback(ev)

    def _fallback(self, ev: Event) -> bytes:
        return ev.raw

    def close(self) -> bytes:
        if self.closed:
            return b""
        self.closed = True
        return b"".join(self._safe_event(ev) for ev in self.parser.close()) + self._end()

    def _end(self) -> bytes:
        """The server ended the stream without [DONE]: the row is written now, before the end of
        the body reaches the harness; if it cannot be, the harness gets an error event, not a
        clean end (a call is never answered as a success unrecorded)."""
        if self.saw_done or self.on_final is None:
            return b""
        err = self._final()
        return b"" if err is None else error_event(err)

    def release(self) -> None:
        """Drop the per-flow buffers now: mitmproxy keeps this callable on the finished flow, and
        finished flows wait for the cyclic GC (~500 MB at 64 streams: docs/benchmarks/proxy.md,
        "Anchors measured before the addon")."""
        self.parser = SSEParser()
        self.assembler = None
        self.t = None

    def _event(self, ev: Event) -> bytes:
        raise NotImplementedError


class StreamFilter(_Base):
    """Chat / completions SSE in, the same events less the proxy's fields out."""

    mid_stream_error: object = None  # the error of a server's mid-stream error event (JSON)

    def __init__(self, cap: CallTokens, extract: ExtractFn, assembler: Assembler):
        super().__init__(cap, extract)
        self.assembler = assembler

    def _event(self, ev: Event) -> bytes:
        if ev.data_bytes is None:  # comment / keep-alive / bare event line
            return ev.raw
        if ev.data_bytes == b"[DONE]":
            self.saw_done = True
            err = self._final()
            if err is not None:  # the call is not recorded: the harness must not see it complete
                return error_event(err, newline=ev.newline)
            return ev.raw
        obj = self._parse(ev)
        if not isinstance(obj, dict):
            return ev.raw
        self.saw_data = True
        if obj.get("error") is not None and "choices" not in obj:
            self.cap.notes.append("server sent an error event mid-stream")
            self.mid_stream_error = obj.get("error")
        try:
            self.extract(self.cap, obj)
        except Exception as exc:  # noqa: BLE001 - a malformed chunk: the row says so, the chunk is still stripped
            self.cap.errors.append(f"malformed stream chunk ({type(exc).__name__}: {exc})")
        plan = self.cap.plan
        changed = strip_response(plan, obj)
        if changed is None:
            return b""
        try:
            self.assembler.add(obj)
        except Exception as exc:  # noqa: BLE001 - only the logged response text is affected
            self.cap.notes.append(f"response text not reassembled from a chunk ({type(exc).__name__}: {exc})")
        if not changed:
            return ev.raw
        data = ev.data_bytes
        if has_escapes(data):  # (lone surrogates, \u-escaped text: written back as the server wrote them)
            out = dumps_stripped(data, lambda o: strip_response(plan, o))
            if out is not None:
                return serialize_event(ev, out)
        elif json_style(data) == COMPACT_UTF8:
            if not plan.harness_logprobs:
                # no floats left once the proxy's own logprobs are nulled: the fast serializer is exact
                try:
                    return serialize_event(ev, dumps_fast(obj))
                except TypeError:  # e.g. a lone surrogate orjson refuses: the slow path writes it
                    pass
            else:  # the harness's logprobs: each float as the server printed it
                out = dumps_faithful(data, lambda o: strip_response(plan, o))
                if out is not None:
                    return serialize_event(ev, out)
        return serialize_event(ev, dumps_like_safe(data, obj))

    def response_text(self) -> bytes:
        return dumps_like_python(self.assembler.result())


class TranslatedStream(_Base):
    """Upstream chat SSE in, the translator's SSE (Responses / Messages) out."""

    def __init__(self, cap: CallTokens, extract: ExtractFn, translator: ChatTranslator, assembler: Assembler):
        super().__init__(cap, extract)
        self.t = translator
        self.assembler = assembler  # reassembles the upstream chat answer for the log
        self.finished = False

    def _event(self, ev: Event) -> bytes:
        if ev.data_bytes is None:
            return b""  # upstream keep-alives are the chat stream's, not the harness API's
        if ev.data_bytes == b"[DONE]":
            self.saw_done = True
            out = self._finish()
            err = self._final()
            if err is not None:  # not recorded: the harness gets its API's failure, not completion
                return self.t.fail(err) or b""
            return out
        obj = self._parse(ev)
        if not isinstance(obj, dict):
            return b""
        self.saw_data = True
        self.extract(self.cap, obj)
        self.assembler.add(obj)
        return self.t.feed_chunk(obj) or b""

    def _fallback(self, ev: Event) -> bytes:
        return b""  # a chat event is no valid event of the harness's API

    def _finish(self) -> bytes:
        if self.finished:
            return b""
        self.finished = True
        return self.t.finish() or b""

    def _end(self) -> bytes:
        if not self.saw_done:
            self.finished = True
            return self.t.fail("upstream stream ended without [DONE]") or b""
        return b""

    def response_text(self) -> bytes:
        return dumps_like_python(self.assembler.result())

