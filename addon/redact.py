"""Keep secrets out of logs: credentials in headers and in JSON bodies are replaced before a row
is written. The request sent upstream is never changed by this module."""
from __future__ import annotations

from typing import Any

REDACTED = "[redacted]"

# Lower-case names. Headers and JSON keys with these names never reach a log.
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key", "api-key", "cookie"})
SECRET_KEYS = frozenset({"api_key", "api-key", "apikey", "x-api-key", "authorization", "access_token"})


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
