"""Entry point of the API translators: which harness API a request speaks, and its translator.

`translator_for(method, path)` answers None for anything but POST /v1/responses (Codex CLI) and
POST /v1/messages (Claude Code, which adds `?beta=true`); a path without the /v1 prefix is
accepted too, because an ANTHROPIC_BASE_URL / base_url that already ends in /v1 is a common
configuration. Each call returns a NEW translator object, which holds the per-call state:

    t.api                              "responses" | "messages"
    t.request_to_chat(body, headers)   -> chat-completions body (no token-id flags)
    t.notes, t.auxiliary, t.metadata   set by request_to_chat
    t.response_from_chat(chat_resp)    non-streaming answer in the harness's API
    t.feed_chunk(chunk) -> bytes       one upstream chat chunk -> SSE bytes for the harness
    t.finish() -> bytes                at upstream [DONE]: closing events with usage
    t.fail(message) -> bytes           upstream failure mid-stream: the API's error event
    t.error_body(status, message)      -> (body, content type) in the API's error shape
    t.error_from_chat(status, body)    -> (status, body, content type) for an upstream error

`normalize=False` turns off the per-harness normalizations (billing line removal, auxiliary
flagging); each one applied is listed in t.notes.
"""
from __future__ import annotations

from polar_contracts.translate.common import TranslationError
from polar_contracts.translate.messages_api import MessagesTranslator
from polar_contracts.translate.responses_api import ResponsesTranslator

__all__ = ["TranslationError", "translator_for", "MessagesTranslator", "ResponsesTranslator"]

_ROUTES = {"/v1/responses": ResponsesTranslator, "/responses": ResponsesTranslator,
           "/v1/messages": MessagesTranslator, "/messages": MessagesTranslator}


def translator_for(method: str, path: str, *, normalize: bool = True):
    if method.upper() != "POST":
        return None
    route = path.split("?", 1)[0].split("#", 1)[0].rstrip("/")
    cls = _ROUTES.get(route)
    return cls(normalize=normalize) if cls else None


def responses_to_chat(body: dict) -> dict:
    """A Responses request as the chat request the proxy sends upstream (entry point for recon)."""
    return translator_for("POST", "/v1/responses").request_to_chat(body, {})


def messages_to_chat(body: dict) -> dict:
    """A Messages request as the chat request the proxy sends upstream (entry point for recon)."""
    return translator_for("POST", "/v1/messages").request_to_chat(body, {})
