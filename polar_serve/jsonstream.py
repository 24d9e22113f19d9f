"""Incremental JSON re-serialization for streaming tool-call arguments (sans-IO).

A tool call's `arguments` reach the client in the non-streaming answer as
`json.dumps(json.loads(raw), ensure_ascii=False)`: the model's raw JSON re-serialized. While the raw
text is still growing, `JsonScanner.feed(raw)` returns the longest prefix of that final serialization
that is already certain: complete punctuation, the decoded characters of an open string (an escape
sequence only once it is whole), and numbers / literals only once a delimiter ends them (a "1" may
still become "12" or "1.5"). So every streamed fragment is a prefix of the final text and the
fragments add up to the non-streamed arguments exactly (property-tested in tests/serve).

Scanning is incremental: the scanner keeps what it consumed and resumes there when the raw text has
only grown (it starts over if the text changed under it). At depth 1 it also records each member's
key, raw value span and (for strings) decoded value, which is how a `<tool_call>` body's `name` and
the start of its `arguments` value are found without a second parser.

Known limit, shared with the real servers: a duplicate key (`{"a": 1, "a": 2}`) is streamed as
written, while json.loads keeps only the last value.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d*)?)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # what json.loads accepts
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WS = " \t\n\r"
_HEX, _HEX_PREFIX = re.compile(r"[0-9a-fA-F]{4}"), re.compile(r"[0-9a-fA-F]{0,3}")
_LOW_PREFIX = re.compile(r"(\\(u([dD]([c-fC-F][0-9a-fA-F]{0,2})?)?)?)?")  # a prefix of \uDC00-\uDFFF
_DELIMS = _WS + ",]}"
_encode = json.encoder.encode_basestring  # json.dumps' string encoder with ensure_ascii=False


@dataclass
class Member:
    """A depth-1 member of the scanned object: raw value span and, for a string, its decoded value."""
    start: int
    end: int | None = None
    string: str | None = None


@dataclass
class JsonScanner:
    raw: str = ""                      # the raw text consumed so far
    out: list[str] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)
    expect: str = "value"              # value | key | key_or_close | value_or_close | colon | comma_or_close
    in_string: bool = False
    string_is_key: bool = False
    decoded: list[str] = field(default_factory=list)   # the open string's characters
    done: bool = False                 # the top-level value is complete
    end: int | None = None             # index in raw just after the top-level value
    error: str | None = None           # the raw text is not JSON (the scan stops)
    members: dict[str, Member] = field(default_factory=dict)
    key: str | None = None             # the depth-1 key whose value is being scanned

    def feed(self, raw: str) -> str:
        """Scan `raw` (the whole text so far) and return the certain canonical prefix."""
        if not raw.startswith(self.raw):
            self.__init__()
        pos = len(self.raw)
        while pos < len(raw) and not self.done and self.error is None:
            step = self._string_step(raw, pos) if self.in_string else self._step(raw, pos)
            if step == 0:
                break  # the next token is incomplete: wait for more text
            pos += step
        self.raw = raw[:pos]
        return self.text

    @property
    def text(self) -> str:
        if len(self.out) > 1:  # keep one joined piece: a long argument is fed thousands of times
            self.out[:] = ["".join(self.out)]
        return self.out[0] if self.out else ""

    # -- structure ---------------------------------------------------------------------------------
    def _step(self, raw: str, pos: int) -> int:
        c = raw[pos]
        if c in _WS:
            return 1
        e = self.expect
        if e == "colon":
            return self._punct(":", ": ", "value") if c == ":" else self._fail(c, pos)
        if e == "comma_or_close":
            if c == ",":
                return self._punct(",", ", ", "key" if self.stack[-1] == "{" else "value")
            return self._close(c, pos)
        if e in ("key", "key_or_close"):
            if c == "}" and e == "key_or_close":
                return self._close(c, pos)
            if c != '"':
                return self._fail(c, pos)
            return self._open_string(key=True)
        if c == "]" and e == "value_or_close":
            return self._close(c, pos)
        return self._value(raw, pos)

    def _value(self, raw: str, pos: int) -> int:
        c = raw[pos]
        if len(self.stack) == 1 and self.key is not None:
            self.members[self.key] = Member(pos)
        if c in "{[":
            self.stack.append(c)
            self.out.append(c)
            self.expect = "key_or_close" if c == "{" else "value_or_close"
            return 1
        if c == '"':
            return self._open_string(key=False)
        return self._scalar(raw, pos)

    def _scalar(self, raw: str, pos: int) -> int:
        rest = raw[pos:]
        for lit in _LITERALS:
            if rest.startswith(lit):
                return self._finish_scalar(raw, pos, lit, lit)
            if lit.startswith(rest):
                return 0
        m = _NUMBER.match(rest)
        if m and m.end() < len(rest) and rest[m.end()] in _DELIMS:
            num = m.group()
            return self._finish_scalar(raw, pos, num, json.dumps(json.loads(num)))
        if _NUMBER_PREFIX.fullmatch(rest):
            return 0  # "1", "1.", "-", "1e": the number may still grow
        return self._fail(rest[0], pos)

    def _finish_scalar(self, raw: str, pos: int, token: str, canon: str) -> int:
        after = pos + len(token)
        if after < len(raw) and raw[after] not in _DELIMS:
            return self._fail(raw[after], after)
        if after == len(raw) and self.stack:
            return 0  # "true" might be the start of "trueish" (invalid): wait for the delimiter
        self.out.append(canon)
        self._value_done(after)
        return len(token)

    def _punct(self, ch: str, canon: str, expect: str) -> int:
        self.out.append(canon)
        self.expect = expect
        return 1

    def _close(self, c: str, pos: int) -> int:
        want = "}" if self.stack and self.stack[-1] == "{" else "]"
        if c != want:
            return self._fail(c, pos)
        self.stack.pop()
        self.out.append(c)
        self._value_done(pos + 1)
        return 1

    def _value_done(self, end: int) -> None:
        if len(self.stack) == 1 and self.key is not None and self.key in self.members:
            self.members[self.key].end = end
            self.key = None
        if not self.stack:
            self.done, self.end = True, end
        else:
            self.expect = "comma_or_close"

    def _fail(self, c: str, pos: int) -> int:
        self.error = f"unexpected {c!r} at {pos}"
        return 0

    # -- strings -----------------------------------------------------------------------------------
    def _open_string(self, key: bool) -> int:
        self.in_string, self.string_is_key, self.decoded = True, key, []
        if not key:
            self.out.append('"')
        return 1

    def _string_step(self, raw: str, pos: int) -> int:
        c = raw[pos]
        if c == '"':
            return self._close_string(pos)
        if c == "\\":
            ch, n = _escape(raw, pos)
            if n <= 0:
                if n < 0:
                    return self._fail(c, pos)
                return 0
        elif c < " ":
            return self._fail(c, pos)  # json.loads (strict) rejects raw control characters
        else:
            ch, n = c, 1
        self.decoded.append(ch)
        if not self.string_is_key:
            self.out.append(_encode(ch)[1:-1])
        return n

    def _close_string(self, pos: int) -> int:
        s = "".join(self.decoded)
        self.in_string = False
        if self.string_is_key:
            self.out.append(_encode(s))
            if len(self.stack) == 1:
                self.key = s
            self.expect = "colon"
            return 1
        self.out.append('"')
        if len(self.stack) == 1 and self.key is not None and self.key in self.members:
            self.members[self.key].string = s
        self._value_done(pos + 1)
        return 1


def _escape(raw: str, pos: int) -> tuple[str, int]:
    """(decoded char, raw length) of the escape at raw[pos]; length 0 = incomplete, -1 = invalid."""
    if pos + 1 >= len(raw):
        return "", 0
    e = raw[pos + 1]
    if e in _ESCAPES:
        return _ESCAPES[e], 2
    if e != "u":
        return "", -1
    hexpart = raw[pos + 2:pos + 6]
    if not _HEX.fullmatch(hexpart):
        return ("", 0) if len(hexpart) < 4 and _HEX_PREFIX.fullmatch(hexpart) else ("", -1)
    cp = int(hexpart, 16)
    if 0xD800 <= cp < 0xDC00:
        # A high surrogate pairs with a following \uDC00-\uDFFF into one character (json.loads does).
        nxt = raw[pos + 6:pos + 12]
        if len(nxt) < 6 and _LOW_PREFIX.fullmatch(nxt):
            return "", 0
        if len(nxt) == 6 and _LOW_PREFIX.fullmatch(nxt):
            low = int(nxt[2:], 16)
            return chr(0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)), 12
    return chr(cp), 6
