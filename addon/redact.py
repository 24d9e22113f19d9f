"""Keep secrets out of logs: credentials in headers and in JSON bodies are replaced before a row
is written. The request sent upstream is never changed by this module.

Two nets. By key: a header or JSON key whose name looks like a credential (``SECRET_KEY_PATTERN``:
token, password, secret, api key, authorization, cookie, credential..., any case, with any prefix
such as ``client_secret`` or ``x-goog-api-key``; not ``max_tokens``) has its value replaced. By
value: every credential the proxy knows (``Credentials``: its control secret, the upstream's API
key, the keys harnesses send in their headers, the episode's capability mac) is replaced wherever
it appears in a logged text, e.g. inside a tool result after the agent ran ``env``."""
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
# Query parameters that carry a credential under a name too generic for SECRET_KEY_PATTERN: the
# Gemini API's `?key=<API key>` (a JSON body's "key" is not one).
QUERY_SECRET_NAMES = frozenset({"key"})
SECRET_KEYS = frozenset({"api_key", "api-key", "apikey", "x-api-key", "authorization", "access_token"})
# A credential's key name (matched whole, any case): one of these words, optionally after any
# prefix ending in - _ or . (client_secret, x-goog-api-key, aws.secret). Singular "token" only:
# max_tokens, prompt_token_ids are not secrets.
_SECRET_WORDS = (r"token|(?:access|refresh|id|auth|session|bearer|api|csrf|github|hf)[-_]?token|passwords?|passwd|"
                 r"pass[-_]?phrase|secrets?|client[-_]?secret|secret[-_]?key|api[-_]?key|apikey|private[-_]?key|"
                 r"authorization|proxy[-_]?authorization|cookies?|set[-_]?cookie|credentials?|x[-_]?polar[-_]?control")
MAX_KEY_PREFIX = 64  # a longer prefix is not looked for (the raw-body scan needs a bounded match)
SECRET_KEY_PATTERN = re.compile(rf'(?:[^"]{{0,{MAX_KEY_PREFIX}}}[-_.])?(?:{_SECRET_WORDS})', re.I)
SECRET_KEY_MATCH_MAX = MAX_KEY_PREFIX + 64  # the longest key the pattern matches (with its quotes)


def is_secret_key(name: object) -> bool:
    """Whether a header or JSON key names a credential (SECRET_KEY_PATTERN, matched whole)."""
    return isinstance(name, str) and (name.lower() in SECRET_KEYS or SECRET_KEY_PATTERN.fullmatch(name) is not None)


# The same, as a quoted JSON key in raw bytes (its value follows): for the value search of a body
# that does not parse.
SECRET_KEY_BYTES_RE = re.compile(rb'"(?:[^"\\]{0,%d}[-_.])?(?:%s)"' % (MAX_KEY_PREFIX, _SECRET_WORDS.encode()),
                                 re.I)
# Whether a raw body may name one: a key ending in one of the words, searched in the lower-cased
# bytes (a case-sensitive search of lower() is 7x faster than re.I over an 80 KB body). A false
# positive only costs a whole parse (redact_json then decides exactly). Any \u escape of a
# printable ASCII character is one too: JSON encoders never write one, but a key spelled
# "api\u005fkey" is api_key to the server; such a body is parsed and redacted whole.
# The last word (and closing quote) of every key SECRET_KEY_PATTERN matches, each found with
# bytes.find (sre takes 2.7 ms to scan 80 KB for an alternation of them; 14 finds take 0.1 ms);
# each hit is then checked whole (is_secret_key): "cache_control" is in every Claude Code request
# and is no secret.
_KEY_ENDS = tuple(w.encode() + b'"' for w in (
    "token", "password", "passwords", "passwd", "phrase", "secret", "secrets", "key", "authorization", "cookie",
    "cookies", "credential", "credentials", "control"))
_COLON_RE = re.compile(rb'\s*:')
_ESCAPE_RE = re.compile(rb'\\u00[2-7][0-9a-f]')


class SecretKeyScan:
    """``search(raw, pos, endpos)``: truthy where ``raw[pos:endpos]`` names a credential key as a
    JSON key (re.Pattern's signature, for CleanRequests), else None. Any \\u escape of a printable
    ASCII character counts too: JSON encoders never write one, but a key spelled "api\\u005fkey"
    is api_key to the server; such a body is parsed and redacted whole."""

    def search(self, raw: bytes, pos: int = 0, endpos: int | None = None):
        end = len(raw) if endpos is None else endpos
        low = raw[pos:end].lower()
        esc = _ESCAPE_RE.search(low)
        if esc is not None:
            return esc
        for word in _KEY_ENDS:
            i = low.find(word)
            while i >= 0:
                close = pos + i + len(word) - 1  # the key's closing quote, in raw
                if _COLON_RE.match(raw, close + 1):
                    start = raw.rfind(b'"', max(0, close - MAX_KEY_PREFIX - 40), close)
                    if start >= 0 and is_secret_key(raw[start + 1:close].decode("latin-1")):
                        return raw[start:close + 1]
                i = low.find(word, i + 1)
        return None


SECRET_KEY_SCAN = SecretKeyScan()


_QUERY_SECRET = re.compile(r"(?:^|[?&;])([^=&;]*)=([^&;#]*)")


def credential_values(fields, path: str = "") -> list[str]:
    """The credentials a request carries outside its body: secret headers' values (and the token
    after an ``Authorization`` scheme such as ``Bearer``), and the values of query parameters
    with a secret key's name. An upstream error may quote any of them back."""
    out: list[str] = []
    for name, value in fields:
        n = name.decode("latin-1").lower() if isinstance(name, bytes) else str(name).lower()
        if n in SECRET_HEADERS or is_secret_key(n):
            v = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            out.append(v)
            token = v.partition(" ")[2]
            if token.strip():
                out.append(token.strip())
    if "?" in path:
        for m in _QUERY_SECRET.finditer(path.partition("?")[2].partition("#")[0]):
            name = unquote_plus(m.group(1))
            if (is_secret_key(name) or name.lower() in QUERY_SECRET_NAMES) and m.group(2):
                out.extend({m.group(2), unquote_plus(m.group(2))})
    return out


def redact_headers(headers: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if k.lower() in SECRET_HEADERS or is_secret_key(k) else v) for k, v in headers.items()}


def redact_json(value: Any) -> Any:
    """A copy of a JSON value with every secret key's value replaced (at any depth)."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if is_secret_key(k) else redact_json(v))
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
            if is_secret_key(k):
                if isinstance(v, str):
                    out.append(v)
            else:
                out.extend(secret_values(v))
    elif isinstance(value, list):
        for v in value:
            out.extend(secret_values(v))
    return out


_QUOTED_VALUE_AFTER_KEY = re.compile(SECRET_KEY_BYTES_RE.pattern + rb'\s*:\s*"((?:[^"\\]|\\.)*)"', re.I)


def secret_values_in_bytes(raw: bytes) -> list[str]:
    """Best effort for a body that is not valid JSON: the quoted values after secret key names."""
    return [m.group(1).decode("utf-8", "replace") for m in _QUOTED_VALUE_AFTER_KEY.finditer(raw)]


class Scrubber:
    """Replaces known secret values (at least ``min_len`` characters, also JSON-escaped) in log text."""

    def __init__(self, secrets, min_len: int = 4):
        forms = set()
        for sec in secrets:
            if isinstance(sec, str) and len(sec) >= min_len:
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
            if is_secret_key(k):
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


# A credential learned from traffic (a harness's key) is scrubbed by value only from this length:
# a short placeholder ("EMPTY", "none") would otherwise blank ordinary words in every logged text.
LEARNED_MIN_LEN = 8
MAX_LEARNED = 64


class Credentials:
    """Every credential the proxy knows, to scrub by value from whatever it logs: the configured
    ones (control secret, upstream API key) and the latest ``MAX_LEARNED`` harness keys seen in
    request headers. ``scrubber(extra)`` adds a call's own (its capability's mac)."""

    def __init__(self) -> None:
        self._configured: dict[str, str] = {}
        self._learned: OrderedDict[str, None] = OrderedDict()
        self._cached: Scrubber | None = None

    def configure(self, name: str, value: str | None) -> None:
        if value:
            self._configured[name] = value
        else:
            self._configured.pop(name, None)
        self._cached = None

    def learn(self, values) -> None:
        for v in values:
            if isinstance(v, str) and len(v) >= LEARNED_MIN_LEN and v not in self._configured.values():
                if v in self._learned:
                    self._learned.move_to_end(v)
                    continue
                self._learned[v] = None
                self._cached = None
                while len(self._learned) > MAX_LEARNED:
                    self._learned.popitem(last=False)

    def values(self) -> list[str]:
        return [*self._configured.values(), *self._learned]

    def scrubber(self, extra=()) -> Scrubber:
        extra = [e for e in extra if e]
        if not extra:
            if self._cached is None:
                self._cached = Scrubber(self.values())
            return self._cached
        return Scrubber([*self.values(), *extra])
