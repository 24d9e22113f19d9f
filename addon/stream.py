"""Streaming response transforms (sans-IO): bytes from the server in, bytes for the harness out,
event by event as they arrive (never buffering the stream).

``StreamFilter`` (chat and completions): events the proxy did not touch pass through with their
exact bytes; an event that carried added fields is re-serialized without them; an event that only
exists because of the proxy's flags (SGLang's sglext chunk) is dropped. ``TranslatedStream`` feeds
the same parsed chunks to a Responses/Messages translator instead.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from .capture import COMPACT_UTF8, CallCapture, dumps_fast, dumps_like, dumps_like_python, json_style
from .dialects import strip_response
from .idlists import MIN_BYTES
from .sse import Event, SSEParser


def serialize_event(ev: Event, data: bytes) -> bytes:
    nl = ev.newline
    head = b"event: " + ev.event.encode() + nl if ev.event is not None else b""
    return head + b"data: " + data + nl + nl


class _Base:
    def __init__(self, cap: CallCapture, extract: Callable[[CallCapture, dict], None]):
        self.cap = cap
        self.extract = extract
        self.parser = SSEParser()
        self.saw_done = False
        self.saw_data = False
        self.closed = False
        self.prompt_cache: Any = None  # idlists.PromptCache, for the big first chunk (vLLM prompt ids)
        self.cache_key = ""

    def _parse(self, ev: Event) -> Any:
        try:
            if self.prompt_cache is not None and len(ev.data_bytes) >= MIN_BYTES:
                return self.prompt_cache.loads(self.cache_key, ev.data_bytes)
            return orjson.loads(ev.data_bytes)
        except orjson.JSONDecodeError as exc:
            self.cap.notes.append(f"unparseable stream event passed through: {exc}")
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
            self.cap.notes.append(f"stream event not filtered ({type(exc).__name__}: {exc})")
            return self._fallback(ev)

    def _fallback(self, ev: Event) -> bytes:
        return ev.raw

    def close(self) -> bytes:
        if self.closed:
            return b""
        self.closed = True
        return b"".join(self._safe_event(ev) for ev in self.parser.close()) + self._end()

    def _end(self) -> bytes:
        return b""

    def release(self) -> None:
        """Drop the per-flow buffers now: mitmproxy keeps this callable on the finished flow, and
        finished flows wait for the cyclic GC (proxy-performance.md: ~500 MB at 64 streams)."""
        self.parser = SSEParser()
        self.assembler = None
        self.t = None

    def _event(self, ev: Event) -> bytes:
        raise NotImplementedError


class StreamFilter(_Base):
    def __init__(self, cap: CallCapture, extract, assembler):
        super().__init__(cap, extract)
        self.assembler = assembler

    def _event(self, ev: Event) -> bytes:
        if ev.data_bytes is None:  # comment / keep-alive / bare event line
            return ev.raw
        if ev.data_bytes == b"[DONE]":
            self.saw_done = True
            return ev.raw
        obj = self._parse(ev)
        if not isinstance(obj, dict):
            return ev.raw
        self.saw_data = True
        if obj.get("error") is not None and "choices" not in obj:
            self.cap.notes.append("server sent an error event mid-stream")
            self.mid_stream_error = obj.get("error")
        self.extract(self.cap, obj)
        changed = strip_response(self.cap.plan, obj)
        if changed is None:
            return b""
        self.assembler.add(obj)
        if not changed:
            return ev.raw
        data = ev.data_bytes
        if not self.cap.plan.harness_logprobs and json_style(data) == COMPACT_UTF8:
            # no floats left once the proxy's own logprobs are nulled: the fast serializer is exact
            try:
                return serialize_event(ev, dumps_fast(obj))
            except TypeError:  # e.g. a lone surrogate orjson refuses: the slow path writes it
                pass
        return serialize_event(ev, dumps_like(data)(obj))

    mid_stream_error: Any = None
    def response_text(self) -> bytes:
        return dumps_like_python(self.assembler.result())


class TranslatedStream(_Base):
    """Upstream chat SSE in, the translator's SSE (Responses / Messages) out."""

    def __init__(self, cap: CallCapture, extract, translator, assembler):
        super().__init__(cap, extract)
        self.t = translator
        self.assembler = assembler  # reassembles the upstream chat answer for the log
        self.finished = False

    def _event(self, ev: Event) -> bytes:
        if ev.data_bytes is None:
            return b""  # upstream keep-alives are the chat stream's, not the harness API's
        if ev.data_bytes == b"[DONE]":
            self.saw_done = True
            return self._finish()
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
