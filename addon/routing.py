"""Which episode a call belongs to, which API it speaks, and the addon's own endpoints (sans-IO).

Episode of a call, first match wins: header ``x-polar-episode``; path prefix
``/polar/<episode_id>/`` (stripped before forwarding); the ``polar_episode`` option.
``POST /polar/<episode_id>/end`` is answered by the addon itself and never forwarded.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polar_contracts.control import END, EPISODE_HEADER, PREFIX, ControlRequestError
from polar_contracts.episode_ids import validate_episode_id

# Model-call endpoints the addon captures itself (others may be handled by the translators).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
API_BY_PATH = {CHAT_PATH: "chat", COMPLETIONS_PATH: "completions"}


class RouteError(ControlRequestError):
    """A request the addon refuses itself (HTTP 400 unless ``status`` says otherwise); the message says why."""


@dataclass(frozen=True)
class Route:
    episode_id: str
    path: str  # the path to forward (prefix stripped), query string included
    is_end: bool = False  # POST /polar/<id>/end


def check_episode_id(episode_id: str, source: str) -> str:
    try:
        return validate_episode_id(episode_id, source)
    except ValueError as exc:
        raise RouteError(str(exc)) from None


def route(method: str, path: str, headers: Mapping[str, str], default_episode: str) -> Route:
    """Resolve the episode and the forwarded path of one request; raises RouteError (400)."""
    prefixed = None
    if path.startswith(PREFIX):
        rest = path[len(PREFIX) :]
        raw_id, slash, tail = rest.partition("/")
        if not slash:  # "/polar/<id>" with nothing after it, or a query string
            raw_id = raw_id.partition("?")[0]
            tail = ""
        prefixed = raw_id
        path = "/" + tail
    header = headers.get(EPISODE_HEADER)
    if header is not None:
        episode = check_episode_id(header, f"header {EPISODE_HEADER}")
        if prefixed is not None:
            check_episode_id(prefixed, "path prefix /polar/<id>/")
    elif prefixed is not None:
        episode = check_episode_id(prefixed, "path prefix /polar/<id>/")
    else:
        episode = check_episode_id(default_episode, "option polar_episode")
    is_end = prefixed is not None and path.partition("?")[0] in (f"/{END}", f"/{END}/")
    if is_end:
        episode = check_episode_id(prefixed, "path prefix /polar/<id>/")
        if method.upper() != "POST":
            raise RouteError(f"/polar/{episode}/end accepts POST only, not {method}", status=405)
    return Route(episode, path, is_end)


def api_of(method: str, path: str) -> str | None:
    """'chat' | 'completions' for the model calls this module captures, else None."""
    if method.upper() != "POST":
        return None
    return API_BY_PATH.get(path.partition("?")[0].rstrip("/") or "/")
