"""Entry point of the API translators: which harness API a request speaks, and its translator.

`translator_for(method, path)` answers None for anything but POST /v1/responses (Codex CLI) and
POST /v1/messages (Claude Code, which adds `?beta=true`) and POST
/v1beta/models/<model>:generateContent | :streamGenerateContent (Gemini CLI; the model and whether to
stream come from the path); a Responses/Messages path without the /v1 prefix is accepted too,
because an ANTHROPIC_BASE_URL / base_url that already ends in /v1 is a common configuration.
Each call returns a NEW translator object, which holds the per-call state:

    t.api                              "responses" | "messages" | "gemini"
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

import re
from urllib.parse import unquote

from polar_contracts.translate.common import TranslationError
from polar_contracts.translate.gemini_api import GeminiTranslator
from polar_contracts.translate.messages_api import MessagesTranslator
from polar_contracts.translate.responses_api import ResponsesTranslator

__all__ = ["TranslationError", "translator_for", "GeminiTranslator", "MessagesTranslator", "ResponsesTranslator"]

_ROUTES = {"/v1/responses": ResponsesTranslator, "/responses": ResponsesTranslator,
           "/v1/messages": MessagesTranslator, "/messages": MessagesTranslator}
# The Gemini API names the model and the action in the path: /v1beta/models/<model>:<action>.
# A model id is one path segment (percent-encoded if it holds a slash); no dot segments.
_GEMINI = re.compile(r"/(?:v1|v1beta|v1alpha)/models/([^/:?#]+):(generateContent|streamGenerateContent)")


def translator_for(method: str, path: str, *, normalize: bool = True):
    if method.upper() != "POST":
        return None
    route, _, query = path.split("#", 1)[0].partition("?")
    route = route.rstrip("/")
    cls = _ROUTES.get(route)
    if cls:
        return cls(normalize=normalize)
    m = _GEMINI.fullmatch(route)
    if m is None or m.group(1) in (".", ".."):
        return None
    stream = m.group(2) == "streamGenerateContent"
    sse = "alt=sse" in query.split("&")
    return GeminiTranslator(normalize=normalize, model=unquote(m.group(1)), stream=stream, sse=sse)


def responses_to_chat(body: dict) -> dict:
    """A Responses request as the chat request the proxy sends upstream (entry point for recon)."""
    return translator_for("POST", "/v1/responses").request_to_chat(body, {})


def gemini_to_chat(body: dict) -> dict:
    """A Gemini request body as the chat request the proxy sends upstream (entry point for recon;
    the model and streaming, which the path gives, do not change the rendered tokens)."""
    return GeminiTranslator().request_to_chat(body, {})


def messages_to_chat(body: dict) -> dict:
    """A Messages request as the chat request the proxy sends upstream (entry point for recon)."""
    return translator_for("POST", "/v1/messages").request_to_chat(body, {})
