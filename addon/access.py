"""Who may ask the proxy what: the first addon every request meets (mitmproxy addon).

It classifies the request (routing.py: a control request, a model call, or anything else), checks
the control secret and the episode's capability (polar_contracts/control.py), bounds the body,
and leaves the route in ``flow.metadata`` for the addon of that concern (control_plane.py,
weight_sync.py, model_calls.py). A refused request is answered here with a JSON error, logged to
``LOGDIR/refused.jsonl`` (refused.py) and never forwarded. Fails closed: an exception in here is
a refusal too, never a request let through.

No control secret configured: the control plane is open (anyone who reaches the proxy may end an
episode or sync the weights), as when a user runs mitmdump by hand; the proxy warns once at start.
The model-API allowlist applies either way.
"""
from __future__ import annotations

import logging

from mitmproxy import ctx, exceptions, http

from addon.body_shape import MAX_JSON_DEPTH, MAX_JSON_ELEMENTS, ShapeRefused
from addon.body_work import MAX_PENDING, BodyLimits, BodyWork, EpisodeBusy
from addon.bounded_decode import BodyTooLarge, EncodingRefused, bounded_decode
from addon.proxy_state import DECODED_BODY, ROUTE, ProxyState, error_response
from addon.redact import credential_values
from addon.refused import redact_path
from addon.routing import MODEL, MODELS, RouteError, claimed_episode, route
from polar_contracts.control import (
    CONTROL_HEADER,
    EPISODE_HEADER,
    MAX_CONTROL_BODY,
    ControlRequestError,
    read_secret_file,
)

log = logging.getLogger("polar")

MAX_BODY = 64 * 1024 * 1024  # default bound on a model call's body (option polar_max_body)
OPEN_WARNING = ("polar: the proxy's control plane is OPEN: no polar_control_secret(_file) is set, so anyone who "
                "can reach this proxy (an agent under training, through its model API) can end any episode with "
                "any reward and have the server load weights. Set polar_control_secret_file (the rollout node does).")


class Access:
    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self._warned_open = False
        self.body_work = BodyWork()  # each episode's queue of body decoding and measuring (body_work.py)

    def load(self, loader) -> None:
        loader.add_option("polar_control_secret_file", str, "",
                          "File holding the control secret (one line, mode 0600: the way a rollout node hands it "
                          "over without putting it in argv). With a secret, control requests (/polar/<id>/end, "
                          "/polar/@...) need it in header x-polar-control, and model calls must name their episode "
                          "by its capability <episode_id>~<mac>; else 403. Unset: the control plane is open.")
        loader.add_option("polar_control_secret", str, "",
                          "The control secret itself (visible in the process's argv: prefer "
                          "polar_control_secret_file). Never logged.")
        loader.add_option("polar_allowed_hosts", str, "",
                          "Forward-proxy mode (any mode but reverse) without polar_upstream: the destinations "
                          "(host:port, comma-separated) a request may name; any other is refused (403), CONNECT "
                          "included. With polar_upstream every model call goes there whatever the host named.")
        loader.add_option("polar_max_body", int, MAX_BODY,
                          "Refuse (413) a model call whose body is larger than this many bytes.")
        loader.add_option("polar_max_control_body", int, MAX_CONTROL_BODY,
                          "Refuse (413) a control request (episode end, weight sync) whose body is larger than "
                          "this many bytes.")
        loader.add_option("polar_max_json_elements", int, MAX_JSON_ELEMENTS,
                          "Refuse (400), before parsing it, a compressed or large (256 KiB or more) model call body "
                          "that could hold more than this many JSON values (its commas and opening brackets, "
                          "counted without parsing).")
        loader.add_option("polar_max_json_depth", int, MAX_JSON_DEPTH,
                          "Refuse (400), before parsing it, a compressed or large (256 KiB or more) model call body "
                          "that nests JSON deeper than this (smaller bodies: past the parsers' own limit, 400).")
        loader.add_option("polar_max_episode_pending_bytes", int, MAX_PENDING,
                          "Refuse (429) a model call whose body would make its episode's bodies waiting to be "
                          "decompressed and measured (one at a time per episode, off the event loop) exceed this "
                          "many bytes.")

    def configure(self, updated) -> None:
        o = ctx.options
        if "polar_allowed_hosts" in updated:
            allowed_hosts(o.polar_allowed_hosts)  # (raises OptionsError naming a bad entry)
        if "polar_max_episode_pending_bytes" in updated:
            self.body_work.max_pending = o.polar_max_episode_pending_bytes
        for name in ("polar_max_body", "polar_max_control_body", "polar_max_json_elements", "polar_max_json_depth",
                     "polar_max_episode_pending_bytes"):
            if name in updated and getattr(o, name) < 1:
                raise exceptions.OptionsError(f"{name} must be >= 1, not {getattr(o, name)}")
        if updated & {"polar_control_secret", "polar_control_secret_file"}:
            if o.polar_control_secret and o.polar_control_secret_file:
                raise exceptions.OptionsError("set one of polar_control_secret and polar_control_secret_file, "
                                              "not both")
            secret = None
            if o.polar_control_secret_file:
                try:
                    secret = read_secret_file(o.polar_control_secret_file)
                except ValueError as exc:
                    raise exceptions.OptionsError(str(exc)) from None
            elif o.polar_control_secret:
                secret = o.polar_control_secret
                if len(secret) < 16:
                    raise exceptions.OptionsError("polar_control_secret must be at least 16 characters "
                                                  "(polar_contracts.control.new_secret() makes one)")
            self.state.secret = secret
            self.state.credentials.configure("control secret", secret)

    def running(self) -> None:
        if self.state.secret is None and not self._warned_open:
            self._warned_open = True
            log.warning(OPEN_WARNING)

    def http_connect(self, flow: http.HTTPFlow) -> None:
        """A CONNECT (forward-proxy mode): the tunnel's destination is checked as a request's is."""
        try:
            why = destination_refused(flow)
        except Exception:  # noqa: BLE001 - fail closed
            log.exception("polar: destination check of CONNECT %s failed", flow.request.host)
            why = "polar proxy could not check this CONNECT's destination"
        if why is not None:
            self.refuse(flow, 403, why)

    async def request(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        req = flow.request
        try:
            why = destination_refused(flow)
            if why is not None:
                raise RouteError(why, 403)
            self._check(flow)
            r = flow.metadata[ROUTE]
            if r.kind in (MODEL, MODELS):
                await self._model_body(flow, r.episode_id)
        except RouteError as exc:
            self.refuse(flow, exc.status, str(exc))
        except Exception as exc:  # noqa: BLE001 - fail closed: a bug here refuses, never forwards
            log.exception("polar: access check of %s %s failed", req.method, req.path[:200])
            self.refuse(flow, 500, f"polar proxy could not check this request ({type(exc).__name__}); it was not "
                                   f"forwarded")

    def _check(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        heads = {k: req.headers[k] for k in (EPISODE_HEADER, CONTROL_HEADER) if k in req.headers}
        r = route(req.method, req.path, heads, ctx.options.polar_episode, self.state.secret)
        size = len(req.raw_content or b"")
        if r.kind in (MODEL, MODELS):
            if size > ctx.options.polar_max_body:
                raise RouteError(f"request body is {size} bytes; this proxy accepts at most {ctx.options.polar_max_body} "
                                 f"(option polar_max_body)", 413)
            # (the body is decompressed and measured next, maybe off the event loop: _model_body)
            # neither the capability nor any control secret goes upstream (the server may log headers)
            req.headers.pop(EPISODE_HEADER, None)
            req.headers.pop(CONTROL_HEADER, None)
        else:
            if size > ctx.options.polar_max_control_body:
                raise RouteError(f"control request body is {size} bytes; at most {ctx.options.polar_max_control_body} "
                                 f"are accepted (option polar_max_control_body)", 413)
            self._decoded(flow, ctx.options.polar_max_control_body, "polar_max_control_body")
        flow.metadata[ROUTE] = r
        flow.metadata[ROUTE + "_heads"] = heads

    async def _model_body(self, flow: http.HTTPFlow, episode_id: str | None) -> None:
        """A model call's body decompressed within polar_max_body and measured before anything
        parses it (body_work.py); the decoded body is kept for the capture (no second inflate)."""
        req = flow.request
        raw = req.raw_content or b""
        enc = req.headers.get("content-encoding", "").strip()
        encoding = enc if enc and enc.lower() != "identity" else None
        o = ctx.options
        limits = BodyLimits(o.polar_max_body, o.polar_max_json_elements, o.polar_max_json_depth)
        try:
            decoded = await self.body_work.read(episode_id, raw, encoding, limits)
        except BodyTooLarge:
            raise RouteError(f"request body ({len(raw)} bytes, content-encoding {enc}) decompresses to more than "
                             f"{o.polar_max_body} bytes, the most this proxy accepts (option polar_max_body)",
                             413) from None
        except EncodingRefused as exc:
            raise RouteError(str(exc), 415) from None
        except ShapeRefused as exc:
            raise RouteError(str(exc), 400) from None
        except EpisodeBusy as exc:
            raise RouteError(str(exc), 429) from None
        if decoded is not None:
            flow.metadata[DECODED_BODY] = decoded

    @staticmethod
    def _decoded(flow: http.HTTPFlow, limit: int, option: str) -> None:
        """A compressed body is bounded by its decompressed size (a gzip bomb is refused, never
        inflated: bounded_decode.py); the decoded body is kept for the capture (no second inflate).
        A body that does not decode is left to the capture, which passes it through as is."""
        req = flow.request
        enc = req.headers.get("content-encoding", "")
        if not enc.strip() or enc.strip().lower() == "identity" or not req.raw_content:
            return
        try:
            flow.metadata[DECODED_BODY] = bounded_decode(req.raw_content, enc, limit)
        except BodyTooLarge:
            raise RouteError(f"request body ({len(req.raw_content)} bytes, content-encoding {enc}) decompresses to "
                             f"more than {limit} bytes, the most this proxy accepts (option {option})", 413) from None
        except EncodingRefused as exc:
            raise RouteError(str(exc), 415) from None
        except ValueError:
            pass

    def refuse(self, flow: http.HTTPFlow, status: int, reason: str) -> None:
        """Answer ``status`` with ``reason`` (JSON), log the refusal; the request goes nowhere."""
        req = flow.request
        flow.metadata.pop(ROUTE, None)
        flow.response = error_response(status, reason, "polar_refused")
        if req.method.upper() == "HEAD":  # (an answer to HEAD has no body)
            flow.response.content = b""
        try:
            heads = {k.lower(): v for k, v in req.headers.items()}
            scrub = self.state.credentials.scrubber(credential_values(req.headers.fields, req.path))
            # (the capability's mac cut from the path, as in refused.jsonl: the proxy's own log is a log too)
            log.warning("polar: refused %s %s (%d): %s", req.method, scrub(redact_path(req.path)[:200]), status,
                        scrub(reason))
            self.state.refused.record(ctx.options.polar_logdir, method=req.method, path=req.path, status=status,
                                      reason=reason, episode=claimed_episode(req.path, heads), scrub=scrub)
        except Exception:  # noqa: BLE001 - the refusal stands whether or not it could be logged
            log.exception("polar: could not log a refusal")


def allowed_hosts(option: str) -> frozenset[str]:
    """polar_allowed_hosts as host:port strings (lower-case host)."""
    out = set()
    for item in option.split(","):
        item = item.strip().lower()
        if item:
            host, sep, port = item.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise exceptions.OptionsError(f"polar_allowed_hosts: {item!r} is not host:port")
            out.add(item)
    return frozenset(out)


def destination_refused(flow: http.HTTPFlow) -> str | None:
    """Why a request's destination is refused, or None. In reverse mode the destination is the
    proxy's own upstream; with polar_upstream every model call is sent there (model_calls.py). In
    any other mode (forward, transparent, ...) without polar_upstream the client names the host, so
    only the polar_allowed_hosts may be named: the agent reaches the proxy and must not use it to
    reach anything else."""
    if ctx.options.polar_upstream:
        return None
    mode = getattr(flow.client_conn, "proxy_mode", None)
    if getattr(mode, "type_name", "reverse") == "reverse":
        return None
    dest = f"{flow.request.host.lower()}:{flow.request.port}"
    if dest in allowed_hosts(ctx.options.polar_allowed_hosts):
        return None
    return (f"destination {dest} is not the inference server: in forward-proxy mode this proxy forwards only to "
            f"polar_upstream (set it: every model call goes there) or to a host of polar_allowed_hosts")


def fail_closed(access: Access, flow: http.HTTPFlow, what: str, exc: BaseException) -> None:
    """A control addon's hook raised: answer (never forward) and log it."""
    log.exception("polar: %s failed", what)
    status = exc.status if isinstance(exc, ControlRequestError) else 500
    access.refuse(flow, status, f"polar proxy could not handle this {what} ({type(exc).__name__}: {exc}); it was "
                                f"not forwarded")
