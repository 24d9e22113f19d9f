"""How vLLM 0.32 and SGLang 0.5.23 render a chat request into a prompt: render.py (the rules both
share, vLLM's whole), render_sglang.py (SGLang's pydantic models and message conversion).
polar-serve serves with them; reconstruction re-renders with them. RequestError is what both raise
for a request the server would refuse (defined here so that neither module imports the other's
internals)."""
from __future__ import annotations


class RequestError(ValueError):
    """A client error: answered with HTTP 400 (or `status`) and the message, never a crash."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.err_type = err_type
