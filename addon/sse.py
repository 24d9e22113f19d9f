"""Incremental Server-Sent Events parser over bytes (sans-IO).

Bytes go in as the network delivers them; complete events come out with their exact raw bytes,
so a filter can pass an event through byte-identical and re-serialize only the ones it changes.
An event ends at a blank line; any of CRLF, LF or CR ends a line (the SSE spec). A multi-byte
UTF-8 character split across two chunks is never decoded half: only complete events are decoded.
Comment lines (``: keep-alive``) are kept in the event's raw bytes and reported as comments.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# Two consecutive line endings = end of one event. CRLF first so it is not read as CR + LF.
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_LINE = re.compile(rb"\r\n|\r|\n")


@dataclass
class Event:
    raw: bytes  # exactly the bytes received, terminator included
    data: str | None  # data lines joined by "\n"; None when the event had no data line
    event: str | None = None  # the `event:` field, if any
    comments: list[str] = field(default_factory=list)
    newline: bytes = b"\n"  # the line ending this event used (for re-serializing it alike)


def parse_event(raw: bytes) -> Event:
    """Parse one complete event (its raw bytes, terminator included)."""
    data: list[str] = []
    name = None
    comments: list[str] = []
    m = _LINE.search(raw)
    newline = m.group(0) if m else b"\n"
    for line in _LINE.split(raw):
        if not line:
            continue
        text = line.decode("utf-8", errors="replace")
        if text.startswith(":"):
            comments.append(text[1:].lstrip(" "))
            continue
        key, sep, value = text.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if key == "data":
            data.append(value)
        elif key == "event":
            name = value
    return Event(raw, "\n".join(data) if data else None, name, comments, newline)


class SSEParser:
    """feed(bytes) -> complete events; close() -> a trailing unterminated event, if any."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[Event]:
        buf = self._buf + chunk if self._buf else chunk
        events: list[Event] = []
        pos = 0
        n = len(buf)
        while True:
            m = _EVENT_END.search(buf, pos)
            if m is None:
                break
            end = m.end()
            # A CR at the very end may be the first half of a CRLF still in flight: wait for it.
            if end == n and buf[end - 1 : end] == b"\r":
                break
            events.append(parse_event(buf[pos:end]))
            pos = end
        self._buf = buf[pos:] if pos < n else b""
        return events

    @property
    def pending(self) -> bytes:
        return self._buf

    def close(self) -> list[Event]:
        """At end of stream: whatever is left, as an event (a server that omitted the last blank
        line). Returns [] when nothing is left."""
        rest, self._buf = self._buf, b""
        if not rest:
            return []
        return [parse_event(rest)]
