"""Which episode a call belongs to, which API it speaks, and the addon's own endpoints (sans-IO).

Episode of a call, first match wins: header ``x-polar-episode``; path prefix
``/polar/<episode_id>/`` (stripped before forwarding); the ``polar_episode`` option.
``POST /polar/<episode_id>/end`` is answered by the addon itself and never forwarded.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polar_contracts.episode_ids import validate_episode_id

EPISODE_HEADER = "x-polar-episode"
PREFIX = "/polar/"

# Model-call endpoints the addon captures itself (others may be handled by the translators).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
API_BY_PATH = {CHAT_PATH: "chat", COMPLETIONS_PATH: "completions"}


class RouteError(Exception):
    """A request the addon refuses itself (HTTP 400); the message says why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


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
    is_end = prefixed is not None and path.partition("?")[0] in ("/end", "/end/")
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


def parse_end_body(body: bytes) -> tuple[float | None, dict]:
    """The body of POST /polar/<id>/end: {"reward": float, "metadata": {...}} (both optional)."""
    import json
    import math

    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number (a reward must be a finite number)")

    if not body.strip():
        return None, {}
    try:
        obj = json.loads(body, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RouteError(f"episode end body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise RouteError("episode end body must be a JSON object {\"reward\": float, \"metadata\": {...}}")
    unknown = set(obj) - {"reward", "metadata"}
    if unknown:
        raise RouteError(f"episode end body has unknown keys {sorted(unknown)}; allowed: reward, metadata")
    reward = obj.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise RouteError(f"reward must be a number, got {type(reward).__name__}")
    meta = obj.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise RouteError(f"metadata must be a JSON object, got {type(meta).__name__}")
    if reward is not None:
        try:
            reward = float(reward)
        except OverflowError:  # a 400-digit integer
            raise RouteError(f"reward is out of range for a float: {str(obj['reward'])[:40]}...") from None
        if not math.isfinite(reward):  # 1e400 reads as infinity
            raise RouteError(f"reward must be a finite number, got {reward}")
    return reward, meta
