"""What a request to the proxy is, whose it is, and whether it may pass (sans-IO).

Every request is one of:

- a control request: ``POST /polar/<episode_id>/end`` (the end record) or ``/polar/@...`` (weight
  sync endpoints, polar_contracts/control.py). Answered by the proxy itself, never forwarded. With a
  control secret configured it must carry it in ``x-polar-control``, else 403.
- a model-API call the proxy captures (``MODEL_ROUTES``, and the translated APIs'
  ``polar_contracts.translate`` routes: POST chat/completions, completions, responses, messages,
  Gemini ``/v1beta/models/<model>:generateContent`` and ``:streamGenerateContent``),
  or the model listing ``GET /v1/models[/<id>]`` and ``POST /v1/messages/count_tokens`` (forwarded,
  not captured: ``PASS_THROUGH``). Its episode: header ``x-polar-episode``, then
  the path prefix ``/polar/<episode>/`` (stripped before forwarding), then the ``polar_episode``
  option. With a control secret configured the episode must be named by its capability
  (``<episode_id>~<mac>``): a bare id, a wrong mac or no episode at all is 403.
- anything else: refused (403), whoever asks. The agent under training reaches the proxy (its model
  calls go through it), and the inference server behind it has routes that must stay out of its
  reach (polar-serve's ``/polar/reload``, vLLM dev mode's ``/collective_rpc``, ``/pause``,
  ``/sleep``...): only the model API passes, so a path is forwarded only when it is one of those.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from polar_contracts.control import (
    CAP_SEP,
    CONTROL_HEADER,
    CONTROL_PREFIX,
    END,
    ENDPOINTS,
    EPISODE_HEADER,
    PREFIX,
    STATUS_PATH,
    ControlRequestError,
    check_capability,
    check_secret,
    is_capability,
)
from polar_contracts.episode_ids import is_valid_episode_id, validate_episode_id
from polar_contracts.translate import translator_for

# Model-call endpoints the addon captures itself (the translators add theirs: translator_for).
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
API_BY_PATH = {CHAT_PATH: "chat", COMPLETIONS_PATH: "completions"}
MODELS_PATH = "/v1/models"  # GET: the served models (harnesses list them; nothing is captured)
# Forwarded untouched and not captured (they generate no tokens) though not model calls: Claude
# Code counts a prompt's tokens before sending it (Anthropic's POST /v1/messages/count_tokens; the
# Messages API is also served without /v1). The server answers as it would directly (vLLM 0.32: 404).
PASS_THROUGH = frozenset({("POST", "/v1/messages/count_tokens"), ("POST", "/messages/count_tokens")})

# What a request is (Route.kind).
MODEL, MODELS, END_KIND, WEIGHTS = "model", "models", "end", "weights"  # MODELS: forwarded, not captured
STATUS = "status"  # GET /polar/@control: whether this proxy holds a control secret


class RouteError(ControlRequestError):
    """A request the addon refuses itself (HTTP 400 unless ``status`` says otherwise); the message says why."""


@dataclass(frozen=True)
class Route:
    episode_id: str | None  # None: a weight endpoint, or an unnamed GET /v1/models
    path: str  # the path to forward (prefix stripped), query string included
    is_end: bool = False  # POST /polar/<id>/end
    kind: str = MODEL  # MODEL | MODELS | END_KIND | WEIGHTS | STATUS
    endpoint: str | None = None  # WEIGHTS: which of polar_contracts.control.ENDPOINTS
    mac: str | None = None  # the capability's mac that named the episode (a credential: scrubbed from logs)


def check_episode_id(episode_id: str, source: str) -> str:
    try:
        return validate_episode_id(episode_id, source)
    except ValueError as exc:
        raise RouteError(str(exc)) from None


def _bare(path: str) -> str:
    return path.partition("?")[0]


def api_of(method: str, path: str) -> str | None:
    """'chat' | 'completions' for the model calls this module captures, else None."""
    if method.upper() != "POST":
        return None
    return API_BY_PATH.get(_bare(path).rstrip("/") or "/")


def is_models_listing(method: str, path: str) -> bool:
    """GET /v1/models or /v1/models/<model id> (one path segment, no dot segments)."""
    if method.upper() != "GET":
        return False
    p = _bare(path).rstrip("/")
    if p == MODELS_PATH:
        return True
    head, _, name = p.rpartition("/")
    return head == MODELS_PATH and name not in ("", ".", "..") and "%" not in name and "\\" not in name


def is_pass_through(method: str, path: str) -> bool:
    """A model-API route forwarded untouched and not logged (PASS_THROUGH)."""
    return (method.upper(), _bare(path).rstrip("/")) in PASS_THROUGH


def is_model_route(method: str, path: str) -> bool:
    """A path the proxy forwards: a captured model call, the model listing or a PASS_THROUGH route."""
    return api_of(method, path) is not None or translator_for(method, path) is not None or \
        is_models_listing(method, path) or is_pass_through(method, path)


def split_prefix(path: str) -> tuple[str | None, str]:
    """(the episode named by a ``/polar/<episode>/`` prefix or None, the path after it)."""
    if not path.startswith(PREFIX):
        return None, path
    raw, slash, tail = path[len(PREFIX):].partition("/")
    if not slash:  # "/polar/<id>" with nothing after it, or a query string
        raw = raw.partition("?")[0]
        tail = ""
    # a client that percent-encodes the capability's "~" (unreserved, but some encode it anyway);
    # no other escape can be part of an episode id or a mac
    return raw.replace("%7E", CAP_SEP).replace("%7e", CAP_SEP), "/" + tail


def claimed_episode(path: str, headers: Mapping[str, str]) -> str | None:
    """The episode id a request claims (for the refusal log), whether or not it may: the id part of
    a capability, only if it is a valid id; never the mac."""
    for name in (headers.get(EPISODE_HEADER), split_prefix(path)[0]):
        if name:
            eid = name.rpartition(CAP_SEP)[0] if is_capability(name) else name
            if is_valid_episode_id(eid):
                return eid
    return None


def _episode(name: str, source: str, secret: str | None) -> tuple[str, str | None]:
    """(episode id, mac) named by a header or path prefix value."""
    if secret:
        try:
            eid = check_capability(secret, name)
        except ControlRequestError as exc:
            raise RouteError(f"{source}: {exc}", exc.status) from None
        return eid, name.rpartition(CAP_SEP)[2]
    if is_capability(name):  # an open proxy (no secret) takes the id part: harness configs work either way
        name = name.rpartition(CAP_SEP)[0]
    return check_episode_id(name, source), None


def route(method: str, path: str, headers: Mapping[str, str], default_episode: str,
          secret: str | None = None) -> Route:
    """Classify one request and resolve its episode; raises RouteError naming why it is refused
    (403: not a model route, no or wrong secret, no or wrong capability; 400: malformed; 404: no
    such control endpoint; 405: wrong method)."""
    if path.startswith(CONTROL_PREFIX):
        if secret:
            _secret(secret, headers)
        endpoint = _bare(path).rstrip("/")
        if endpoint == STATUS_PATH:
            if method.upper() != "GET":
                raise RouteError(f"{STATUS_PATH} accepts GET only, not {method}", status=405)
            return Route(None, path, kind=STATUS, endpoint=endpoint)
        if endpoint not in ENDPOINTS:
            raise RouteError(f"no control endpoint {endpoint!r} (there are {', '.join((*ENDPOINTS, STATUS_PATH))})",
                             404)
        return Route(None, path, kind=WEIGHTS, endpoint=endpoint)
    prefixed, rest = split_prefix(path)
    if prefixed is not None and _bare(rest) in (f"/{END}", f"/{END}/"):
        if secret:
            _secret(secret, headers)
        eid, mac = _episode(prefixed, "path prefix /polar/<id>/", None)
        if method.upper() != "POST":
            raise RouteError(f"/polar/{eid}/end accepts POST only, not {method}", status=405)
        return Route(eid, rest, is_end=True, kind=END_KIND, mac=mac)
    if not is_model_route(method, rest):
        raise RouteError(f"{method} {_bare(rest)[:200]} is not a model API route: this proxy forwards only "
                         f"POST chat/completions, completions, responses, messages, Gemini "
                         f"models/<model>:generateContent | :streamGenerateContent and GET /v1/models", 403)
    kind = MODELS if is_models_listing(method, rest) or is_pass_through(method, rest) else MODEL
    header = headers.get(EPISODE_HEADER)
    named = [(v, s) for v, s in ((header, f"header {EPISODE_HEADER}"), (prefixed, "path prefix /polar/<id>/"))
             if v is not None]
    if not named:
        if secret:
            raise RouteError(f"the request names no episode: this proxy requires the episode's capability in "
                             f"header {EPISODE_HEADER} or the path prefix /polar/<capability>/", 403)
        return Route(check_episode_id(default_episode, "option polar_episode"), rest, kind=kind)
    found = [_episode(v, s, secret) for v, s in named]  # every name given must be valid; the header wins
    eid, mac = found[0]
    return Route(eid, rest, kind=kind, mac=mac)


def _secret(secret: str, headers: Mapping[str, str]) -> None:
    try:
        check_secret(secret, headers.get(CONTROL_HEADER))
    except ControlRequestError as exc:
        raise RouteError(str(exc), exc.status) from None
