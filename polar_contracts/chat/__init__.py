"""How vLLM 0.32 and SGLang 0.5.23 render a chat request into a prompt: render.py (the rules both
share, vLLM's whole), render_sglang.py (SGLang's pydantic models and message conversion).
polar-serve serves with them; reconstruction re-renders with them. RequestError is what both raise
for a request the server would refuse, and content_parts / part_text the content checks both make
(defined here so that neither module imports the other's internals)."""
from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A client error: answered with HTTP 400 (or `status`) and the message, never a crash."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.err_type = err_type


def content_parts(content: Any, where: str) -> list | None:
    """A message's content as its list of parts; None when it is a string or null (the template
    gets it as is). Both servers refuse any other type."""
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string, a list of content parts or null")
    return content


def part_text(part: dict, i: int, where: str) -> str:
    """A text part's ``text``, which both servers require to be a string."""
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.content[{i}].text must be a string")
    return part["text"]
