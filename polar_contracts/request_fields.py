"""Request fields as vLLM and SGLang read them (pydantic's lax mode), for everyone who must read a
request the way the server will: the proxy's dialects and the API translators."""
from __future__ import annotations

from typing import Any

TRUE_STRINGS = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE_STRINGS = frozenset({"0", "off", "f", "false", "n", "no"})


def lax_bool(v: Any) -> bool | None:
    """A boolean request field as vLLM and SGLang read it (pydantic's lax mode): true, 1, 1.0,
    "true"/"yes"/"on"/"1"... (any case); None when the server would refuse the value (its
    validation error then answers the call)."""
    if isinstance(v, bool):
        return v
    if isinstance(v, (int, float)):
        return True if v == 1 else False if v == 0 else None
    if isinstance(v, str):
        low = v.strip().lower()
        return True if low in TRUE_STRINGS else False if low in FALSE_STRINGS else None
    return None


def lax_int(v: Any) -> int | None:
    """An integer request field as pydantic's lax mode reads it: 5, 5.0, "5"; else None."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            return None
    return None
