"""Keep secrets out of logs: credentials in headers and in JSON bodies are replaced before a row
is written. The request sent upstream is never changed by this module."""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any
from urllib.parse import unquote_plus

from polar_contracts.prefix import shared_ends

REDACTED = "[redacted]"

# Lower-case names. Headers and JSON keys with these names never reach a log.
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"})
SECRET_KEYS = frozenset({"api_key", "api-key", "apikey", "x-api-key", "authorization", "access_token"})


_QUERY_SECRET = re.compile(r"(?:^|[?&;])([^=&;]*)=([^&;#]*)")


def credential_values(fields, path: str = "") -> list[str]:
    """The credentials a request carries outside its body: secret headers' values (and the token
    after an ``Authorization`` scheme such as ``Bearer``), and the values of query parameters
    with a secret key's name. An upstream error may quote any of them back."""
    out: list[str] = []
    for name, value in fields:
        n = name.decode("latin-1").lower() if isinstance(name, bytes) else str(name).lower()
        if n in SECRET_HEADERS:
            v = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            out.append(v)
            token = v.partition(" ")[2]
            if token.strip():
                out.append(token.strip())
    if "?" in path:
        for m in _QUERY_SECRET.finditer(path.partition("?")[2].partition("#")[0]):
            if unquote_plus(m.group(1)).lower() in SECRET_KEYS and m.group(2):
                out.extend({m.group(2), unquote_plus(m.group(2))})
    return out


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if k.lower() in SECRET_HEADERS else v) for k, v in headers.items()}


def redact_json(value: Any) -> Any:
    """A copy of a JSON value with every secret key's value replaced (at any depth)."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and k.lower() in SECRET_KEYS else redact_json(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [redact_json(v) for v in value]
    return value


def secret_values(value: Any) -> list[str]:
    """The string values of secret keys anywhere in a JSON value (to scrub them from text the
    server echoes back: an error that quotes the request, e.g. a validation error's "input")."""
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and k.lower() in SECRET_KEYS:
                if isinstance(v, str):
                    out.append(v)
            else:
                out.extend(secret_values(v))
    elif isinstance(value, list):
        for v in value:
            out.extend(secret_values(v))
    return out


_QUOTED_VALUE_AFTER_KEY = re.compile(
    b'"(?:' + b"|".join(re.escape(k.encode()) for k in sorted(SECRET_KEYS))
    + b')"\\s*:\\s*"((?:[^"\\\\]|\\\\.)*)"', re.I)


def secret_values_in_bytes(raw: bytes) -> list[str]:
    """Best effort for a body that is not valid JSON: the quoted values after secret key names."""
    return [m.group(1).decode("utf-8", "replace") for m in _QUOTED_VALUE_AFTER_KEY.finditer(raw)]


class Scrubber:
    """Replaces known secret values (at least 4 characters, also JSON-escaped) in log text."""

    def __init__(self, secrets: list[str]):
        forms = set()
        for sec in secrets:
            if len(sec) >= 4:
                forms.add(sec)
                forms.add(json.dumps(sec)[1:-1])
                forms.add(json.dumps(sec, ensure_ascii=False)[1:-1])
        self.forms = sorted(forms, key=len, reverse=True)

    def __call__(self, text: Any) -> Any:
        if not self.forms or text is None:  # (the common case: nothing to scrub)
            return text
        if isinstance(text, (bytes, bytearray)):
            for f in self.forms:
                text = bytes(text).replace(f.encode(), REDACTED.encode())
            return text
        for f in self.forms:
            text = text.replace(f, REDACTED)
        return text


def has_secret_key(value: Any) -> bool:
    """Cheap check so the common case (no secret in the body) keeps the harness's own bytes."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str) and k.lower() in SECRET_KEYS:
                return True
            if isinstance(v, (dict, list)) and has_secret_key(v):
                return True
    elif isinstance(value, list):
        return any(isinstance(v, (dict, list)) and has_secret_key(v) for v in value)
    return False


class CleanRequests:
    """Per episode: the last request found free of secret keys, so the next scan reads only what
    changed. An agent's request k+1 repeats request k (system prompt, tools, history) and adds a
    few turns; a key name in the repeated prefix or suffix would have been found in request k.
    So only the differing middle, widened by ``margin`` bytes on both sides (a match can start
    in the prefix and end in the middle), is searched. Bounded: least recently used out."""

    def __init__(self, pattern, margin: int, max_episodes: int = 64):
        self.pattern = pattern
        self.margin = margin
        self.max = max_episodes
        self._last: OrderedDict[str, bytes] = OrderedDict()

    def has_secret(self, key: str, raw: bytes) -> bool:
        prev = self._last.pop(key, None)
        if prev is None:
            hit = self.pattern.search(raw) is not None
        else:
            p, s = shared_ends(prev, raw)
            lo, hi = max(0, p - self.margin), min(len(raw), len(raw) - s + self.margin)
            hit = lo < hi and self.pattern.search(raw, lo, hi) is not None
        if not hit:
            self._last[key] = raw
            while len(self._last) > self.max:
                self._last.popitem(last=False)
        return hit
