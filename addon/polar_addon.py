"""Polar capture addon: ``mitmdump -s "$(python -m addon)" --set polar_logdir=DIR`` (from a checkout
``mitmdump -s addon/polar_addon.py``; the project must be installed in mitmdump's Python).

Thin on purpose: options and mitmproxy hooks only. The protocol logic lives in sans-IO modules
(routing, server_dialects, sse, stream, chat, completions, call, redact); episode files in open_logs.py;
every change to mitmproxy itself in mitmproxy_patches.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.parse
import urllib.request

try:
    import addon  # noqa: F401
except ImportError as exc:  # loaded by path (mitmdump -s) in a Python where the project is not installed
    raise ImportError(
        f"polar: the capture addon's package (`addon`) is not installed in the Python that runs mitmdump "
        f"({exc}). Install the project into mitmdump's environment, e.g. `pip install -e <polar checkout>` "
        f"with that environment's pip, then run `mitmdump -s $(python -m addon) ...`.") from exc

from mitmproxy import ctx, exceptions, http

from addon import call as calls
from addon.applied_sampling import GenerationConfigError, load_generation_config
from addon.idlists import PromptCache
from addon.logprobs_probe import PROBE_TIMEOUT, ModeCache, probe_upstream
from addon.mitmproxy_patches import FastDispatch, Tuning
from addon.open_logs import MAX_OPEN, EpisodeFinished, Episodes
from addon.redact import CleanRequests, credential_values
from addon.routing import CHAT_PATH, RouteError, api_of, check_episode_id, route
from addon.server_dialects import DIALECTS, dialect_from_models
from addon.server_weights import KINDS as SERVER_KINDS
from addon.weight_hold import HoldTimeout, UpstreamWeights
from polar_contracts.control import ENDPOINTS as WEIGHT_ENDPOINTS
from polar_contracts.control import (
    HOLD_PATH,
    PREFIX,
    RELEASE_PATH,
    SYNC_PATH,
    ControlRequestError,
    parse_end_body,
    parse_hold_body,
    parse_release_body,
    parse_sync_request,
)
from polar_contracts.log.table import LogError
from polar_contracts.log.writer import warm_up
from polar_contracts.translate import TranslationError, translator_for

log = logging.getLogger("polar")
META = "polar_call"


def _json_response(status: int, obj: dict) -> http.Response:
    return http.Response.make(status, json.dumps(obj).encode(), {"content-type": "application/json"})


def _error_response(status: int, message: str) -> http.Response:
    return _json_response(status, {"error": {"message": message, "type": "polar_proxy_error", "code": status}})


def _api_error(c: calls.CapturedCall, status: int, message: str) -> http.Response:
    """An answer the proxy gives itself, in the harness's API's error shape."""
    if c.translator is not None:
        body, ctype = c.translator.error_body(status, message)
        return http.Response.make(status, body, {"content-type": ctype})
    return _error_response(status, message)


def _storage_message(exc: BaseException) -> str:
    return (f"polar proxy could not record this call, so it is not answered as a success: the episode "
            f"log cannot be written ({type(exc).__name__}: {exc}). The episode is marked incomplete; "
            f"calls are recorded again once the log directory is writable.")


_FEW = frozenset({b"x-polar-episode", b"content-encoding", b"transfer-encoding"})


def few_headers(headers: http.Headers) -> dict[str, str]:
    """The request headers the hooks read, in one pass over the fields (each Headers.get
    lower-cases every field name); repeated fields joined with ", " as Headers.get does."""
    out: dict[str, str] = {}
    for name, value in headers.fields:
        low = name.lower()
        if low in _FEW:
            k = low.decode("ascii")
            v = value.decode("utf-8", "surrogateescape")
            out[k] = out[k] + ", " + v if k in out else v
    return out


def probe_dialect(base_url: str, timeout: float = 5.0) -> str | None:
    """GET /v1/models on the upstream and read owned_by (see server_dialects.py)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=timeout) as r:
            return dialect_from_models(json.loads(r.read()))
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown"
        log.warning("polar: dialect probe of %s failed: %s", base_url, exc)
        return None


class PolarAddon:
    def __init__(self) -> None:
        self.episodes: Episodes | None = None
        self._auto: dict[str, str] = {}
        self._upstream: urllib.parse.SplitResult | None = None
        self.prompt_cache = PromptCache()  # each episode's last prompt id list (idlists.py)
        # each episode's last request without secret keys (redact.py): the next scan reads the change
        self.clean_requests = CleanRequests(calls.SECRET_KEY_RE, calls.SECRET_MATCH_MAX)
        # flows with a call in flight (SIGTERM: their rows go in before the pending end records)
        self._live: dict[int, http.HTTPFlow] = {}
        self._weights_of: dict[str, UpstreamWeights] = {}  # each upstream's gate and version (weight_hold.py)
        self._weights_lock: asyncio.Lock | None = None
        # sampling defaults of the served model (applied_sampling.py; None: polar_generation_config unset)
        self.sampling_defaults = None
        self._warned_unknown_sampling = False
        self.logprobs_modes = ModeCache()  # each upstream's logprobs mode (logprobs_probe.py)

    # -- options ----------------------------------------------------------------------------------
    def load(self, loader) -> None:
        loader.add_option("polar_logdir", str, "", "Directory for episode logs (<episode_id>.arrow). Required.")
        loader.add_option("polar_dialect", str, "auto",
                          "Inference server dialect: vllm | sglang | auto (ask the server's /v1/models owned_by).")
        loader.add_option("polar_episode", str, "default",
                          "Episode of calls with no x-polar-episode header and no /polar/<id>/ path prefix.")
        loader.add_option("polar_upstream", str, "",
                          "Forward-proxy mode: send model calls (/v1/..., /polar/...) to this server URL "
                          "whatever host the harness names, e.g. http://127.0.0.1:8000.")
        loader.add_option("polar_fsync", bool, False, "fsync each log row (survives power loss, slower).")
        loader.add_option("polar_end_wait_ms", int, 5000,
                          "POST /polar/<id>/end with calls of the episode still in flight: milliseconds to wait "
                          "for them before answering 202 (the end record is written after the last one either way).")
        loader.add_option("polar_max_open_logs", int, MAX_OPEN,
                          "At most this many episode logs hold an open file descriptor; the least recently "
                          "used are closed and reopened on their next row (episodes never ended cost no fd).")
        loader.add_option("polar_max_choices", int, calls.MAX_CHOICES,
                          "Refuse (400) a call asking for more than this many choices (n): each is a log row.")
        loader.add_option("polar_server_kind", str, "auto",
                          "What the upstream is, for its weight version and POST /polar/@weights syncs: vllm (real "
                          "vLLM with VLLM_SERVER_DEV_MODE=1) | sglang | polar-serve | auto (the first of GET "
                          "/weight_info, /model_info, /polar/weight_version that answers; none: versions unknown).")
        loader.add_option("polar_sync_hold_max_ms", int, 300000,
                          "A model call arriving during a weight sync waits at most this long, then gets a 503 "
                          "naming the sync (it is never sent to the server unrecorded).")
        loader.add_option("polar_sync_drain_ms", int, 60000,
                          "A weight sync waits this long for the calls in flight to finish; calls still in flight "
                          "when the load starts are recorded as spanning two versions.")
        loader.add_option("polar_server_api_key", str, "",
                          "API key the proxy sends (as a bearer token) on its own requests to the server (version "
                          "reads, weight syncs); empty: the sync request's Authorization header. Never logged.")
        loader.add_option("polar_generation_config", str, "",
                          "The served model's directory or its generation_config.json: the sampling defaults the "
                          "server applies to fields a request leaves unset. The proxy then writes them into the "
                          "request it forwards and records them on each row (temperature, top_p, top_k, min_p). "
                          "'none': the server applies no model defaults (vLLM --generation-config vllm). Unset: "
                          "such fields are recorded as unknown (null).")
        loader.add_option("polar_logprobs_mode", str, "auto",
                          "What the upstream's logprobs are, recorded on each row: auto (probe each upstream once "
                          "before its first call, again after a weight sync or a failed connection) | processed | "
                          "raw | scaled | unknown (no probe; recorded null).")

    def configure(self, updated) -> None:
        o = ctx.options
        if "polar_dialect" in updated and o.polar_dialect not in (*DIALECTS, "auto"):
            raise exceptions.OptionsError(f"polar_dialect must be vllm, sglang or auto, not {o.polar_dialect!r}")
        if "polar_episode" in updated:
            try:
                check_episode_id(o.polar_episode, "option polar_episode")
            except RouteError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        for name in ("polar_max_open_logs", "polar_max_choices"):
            if name in updated and getattr(o, name) < 1:
                raise exceptions.OptionsError(f"{name} must be >= 1, not {getattr(o, name)}")
        if "polar_max_open_logs" in updated and self.episodes is not None:
            self.episodes.max_open = o.polar_max_open_logs
        if "polar_end_wait_ms" in updated and o.polar_end_wait_ms < 0:
            raise exceptions.OptionsError(f"polar_end_wait_ms must be >= 0, not {o.polar_end_wait_ms}")
        if updated & {"polar_server_kind", "polar_sync_hold_max_ms", "polar_sync_drain_ms"}:
            if o.polar_server_kind not in (*SERVER_KINDS, "auto"):
                raise exceptions.OptionsError(f"polar_server_kind must be one of {', '.join(SERVER_KINDS)} or auto, "
                                              f"not {o.polar_server_kind!r}")
            for name in ("polar_sync_hold_max_ms", "polar_sync_drain_ms"):
                if getattr(o, name) < 0:
                    raise exceptions.OptionsError(f"{name} must be >= 0, not {getattr(o, name)}")
        if updated & {"polar_server_kind", "polar_server_api_key", "polar_upstream", "polar_logdir"}:
            self._weights_of = {}  # learned again at the next call
        if "polar_generation_config" in updated:
            self.sampling_defaults = None
            if o.polar_generation_config:
                try:
                    self.sampling_defaults = load_generation_config(o.polar_generation_config)
                except GenerationConfigError as exc:
                    raise exceptions.OptionsError(str(exc)) from None
        if "polar_logprobs_mode" in updated:
            if o.polar_logprobs_mode not in ("auto", "processed", "raw", "scaled", "unknown"):
                raise exceptions.OptionsError("polar_logprobs_mode must be auto, processed, raw, scaled or unknown, "
                                              f"not {o.polar_logprobs_mode!r}")
            self.logprobs_modes.invalidate()
        if "polar_upstream" in updated:
            self.logprobs_modes.invalidate()
            self._upstream = None
            if o.polar_upstream:
                u = urllib.parse.urlsplit(o.polar_upstream)
                if u.scheme not in ("http", "https") or not u.hostname:
                    raise exceptions.OptionsError(f"polar_upstream must be an http(s) URL, not {o.polar_upstream!r}")
                self._upstream = u
        if "polar_logdir" in updated or "polar_fsync" in updated:
            if not o.polar_logdir:
                raise exceptions.OptionsError("polar_logdir is required: --set polar_logdir=DIR")
            try:
                os.makedirs(o.polar_logdir, exist_ok=True)
            except OSError as exc:
                raise exceptions.OptionsError(f"polar_logdir {o.polar_logdir!r} cannot be created: {exc}") from None
            if not os.access(o.polar_logdir, os.W_OK):
                raise exceptions.OptionsError(f"polar_logdir {o.polar_logdir!r} is not writable")
            if self.episodes is not None:
                self.episodes.close_all()
            self.episodes = Episodes(o.polar_logdir, fsync=o.polar_fsync, max_open=o.polar_max_open_logs)
            warm_up()

    # -- hooks ------------------------------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        req = flow.request
        path = req.path
        translator = None
        api = api_of(req.method, path)
        if path.startswith(SYNC_PATH) and (endpoint := path.partition("?")[0].rstrip("/")) in WEIGHT_ENDPOINTS:
            await self._weights_endpoint(flow, endpoint)
            return
        if not path.startswith(PREFIX) and api is None:
            translator = translator_for(req.method, path)
            if translator is None:
                self._redirect(flow)
                return  # not a model call: pass through untouched, not logged
        heads = few_headers(req.headers)
        try:
            r = route(req.method, path, heads, ctx.options.polar_episode)
        except RouteError as exc:
            flow.response = _error_response(exc.status, str(exc))
            return
        if r.is_end:
            await self._end_episode(flow, r.episode_id)
            return
        if r.path != path:
            req.path = path = r.path
            api = api_of(req.method, path)
            if api is None:
                translator = translator_for(req.method, path)
        model_call = api is not None or translator is not None
        self._redirect(flow, model_call)
        if not model_call:
            return
        if translator is not None:
            api = translator.api
        t_start = time.time()
        try:
            _, call_index = self.episodes.begin_call(r.episode_id)  # counted in flight until _write
        except EpisodeFinished as exc:
            flow.response = _error_response(409, f"{exc}; use a new episode id for new calls")
            return
        except (OSError, LogError) as exc:  # the log cannot be opened: never forward a call unrecorded
            log.error("polar: episode %s: %s", r.episode_id, exc)
            flow.response = _error_response(503, _storage_message(exc))
            return
        try:
            dialect = await self._dialect(flow)
            c = calls.CapturedCall(r.episode_id, call_index, api, dialect, t_start, b"")
            c.translator = translator
            c.prompt_cache = self.prompt_cache
            c.clean_requests = self.clean_requests
            c.max_choices = ctx.options.polar_max_choices
            c.header_secrets = credential_values(req.headers.fields, path)
            c.sampling_defaults = self.sampling_defaults
            ok = self._prepare(flow, c, heads)
            if ok:
                ok = await self._gate(flow, c)
            if ok:
                self._warn_unknown_sampling(c)
                c.logprobs_mode = await self._logprobs_mode(flow, c)
        except BaseException:  # (a bug) the call must not stay in flight: an end would wait forever
            self.episodes.call_done(r.episode_id)
            raise
        if ok:
            flow.metadata[META] = c
            self._live[id(flow)] = flow
            # runs once the request is on its way upstream, while the server works
            asyncio.get_running_loop().call_soon(self._after_send, c)
        else:
            self._write(c)

    def _prepare(self, flow: http.HTTPFlow, c: calls.CapturedCall, heads: dict[str, str]) -> bool:
        """Rewrite the request; False when the proxy answered it itself (the row is final)."""
        req = flow.request
        encoded = heads.get("content-encoding", "identity").lower() not in ("", "identity")
        try:
            raw = req.content if encoded else req.raw_content
        except ValueError as exc:  # a content-encoding that does not decode
            c.errors.append(f"request body could not be decoded ({exc}); passed through unmodified")
            c.request_text = (req.raw_content or b"")[:1000].decode("utf-8", "replace").encode()
            return True
        try:
            new = calls.prepare(c, raw or b"", req.headers)
        except TranslationError as exc:  # the request is invalid in the harness's own API
            c.errors.append(f"request refused by the {c.api} translator: {exc}")
            c.status = 400
            body, ctype = c.translator.error_body(400, str(exc))  # the API's own error shape
            flow.response = http.Response.make(400, body, {"content-type": ctype})
            return False
        except calls.RequestRefused as exc:
            c.errors.append(f"request refused by the proxy: {exc}")
            c.status = 400
            flow.response = _api_error(c, 400, str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - a translator bug: answer, log, keep serving
            log.exception("polar: could not prepare call %s of episode %s", c.call_index, c.episode_id)
            msg = f"polar proxy could not translate this request: {type(exc).__name__}: {exc}"
            c.errors.append(msg)
            c.status = 500
            if c.translator is not None:
                body, ctype = c.translator.error_body(500, msg)
                flow.response = http.Response.make(500, body, {"content-type": ctype})
            else:
                flow.response = _error_response(500, msg)
            return False
        if new is not None:
            if encoded or "transfer-encoding" in heads:
                req.content = new  # re-encodes what the harness compressed; keeps its framing
            else:  # (what set_content does here, without reading the headers again)
                req.raw_content = new
                req.headers["content-length"] = str(len(new))
            if c.translator is not None:
                req.path = (self._upstream.path.rstrip("/") if self._upstream else "") + CHAT_PATH
                req.headers["content-type"] = "application/json"
            # the transforms parse the answer: ask for it uncompressed (the harness still decodes it)
            req.headers["accept-encoding"] = "identity"
        return True

    # -- weight versions and syncs (weight_hold.py) -------------------------------------------------
    def _upstream_base(self, flow: http.HTTPFlow) -> str:
        u = self._upstream
        if u is not None:
            return f"{u.scheme}://{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}{u.path.rstrip('/')}"
        r = flow.request
        return f"{r.scheme}://{r.host}:{r.port}"

    async def _weights(self, base: str, authorization: str | None = None) -> UpstreamWeights:
        """The upstream's gate, its kind and version learned at first contact (asked again every
        DETECT_RETRY_S while unknown)."""
        uw = self._weights_of.get(base)
        if uw is not None and (uw.kind is not None or time.monotonic() < uw.detect_retry_at):
            return uw
        if self._weights_lock is None:
            self._weights_lock = asyncio.Lock()
        async with self._weights_lock:  # one probe per upstream, however many calls arrive at once
            uw = self._weights_of.get(base)
            if uw is not None and uw.kind is None and time.monotonic() >= uw.detect_retry_at:
                await uw.detect(ctx.options.polar_server_kind)
            if uw is None:
                key = ctx.options.polar_server_api_key
                auth = f"Bearer {key}" if key else authorization
                uw = UpstreamWeights(base, None, None, headers={"Authorization": auth} if auth else {},
                                     logdir=ctx.options.polar_logdir)
                await uw.detect(ctx.options.polar_server_kind)
                self._weights_of[base] = uw
        return uw

    async def _gate(self, flow: http.HTTPFlow, c: calls.CapturedCall) -> bool:
        """Wait while a weight sync holds the upstream; False when the proxy answered (503)."""
        uw = await self._weights(self._upstream_base(flow), flow.request.headers.get("authorization"))
        try:
            c.weight_ticket = await uw.enter(ctx.options.polar_sync_hold_max_ms / 1000)
        except HoldTimeout as exc:
            c.errors.append(str(exc))
            c.status = 503
            flow.response = _error_response(503, str(exc))
            return False
        c.weight_hold = uw
        return True

    async def _weights_endpoint(self, flow: http.HTTPFlow, endpoint: str = SYNC_PATH) -> None:
        """GET /polar/@weights: the upstream's version; POST: a weight sync; POST .../hold and
        .../release: this proxy's part in a sync another proxy of the same server runs
        (weight_hold.py)."""
        req = flow.request
        uw = await self._weights(self._upstream_base(flow), req.headers.get("authorization"))
        if req.method == "GET" and endpoint == SYNC_PATH:
            flow.response = _json_response(200, uw.info())
            return
        if req.method != "POST":
            flow.response = _error_response(405, f"{endpoint} accepts {'GET and ' if endpoint == SYNC_PATH else ''}"
                                                 f"POST, not {req.method}")
            return
        try:
            if endpoint == HOLD_PATH:
                version, lease_s = parse_hold_body(req.content or b"")
                status, answer = await uw.hold_for_peer(version, ctx.options.polar_sync_drain_ms / 1000, lease_s)
            elif endpoint == RELEASE_PATH:
                version, after, ok = parse_release_body(req.content or b"")
                status, answer = uw.release_peer(version, after, ok)
                if status == 200:
                    self.invalidate_logprobs_mode(self._upstream_base(flow))  # new weights
            else:
                path, version, peers_drained = parse_sync_request(req.content or b"")
                status, answer = await self._sync(flow, uw, path, version, peers_drained)
        except ControlRequestError as exc:
            flow.response = _error_response(400, str(exc))
            return
        if status != 200:
            answer = {**answer, "error": {"message": answer["error"], "type": "polar_weight_sync_error",
                                          "code": status}}
        flow.response = _json_response(status, answer)

    async def _sync(self, flow: http.HTTPFlow, uw: UpstreamWeights, path: str, version: str,
                    peers_drained: bool) -> tuple[int, dict]:
        req = flow.request
        if not ctx.options.polar_server_api_key and req.headers.get("authorization"):
            uw.headers = {"Authorization": req.headers["authorization"]}
        if uw.kind is None:  # the server may have come up since the first call: ask again
            await uw.detect(ctx.options.polar_server_kind)
        status, answer = await uw.sync(path, version, ctx.options.polar_sync_drain_ms / 1000, peers_drained)
        self.invalidate_logprobs_mode(self._upstream_base(flow))  # new weights, maybe a restarted server
        return status, answer

    # -- sampling and logprobs mode (applied_sampling.py, logprobs_probe.py) ---------------------------------
    def _warn_unknown_sampling(self, c: calls.CapturedCall) -> None:
        if c.sampling_unknown and not self._warned_unknown_sampling:
            self._warned_unknown_sampling = True
            log.warning("polar: a request leaves %s unset and the server's defaults for them are unknown: rows "
                        "record them as null (unknown). Set --set polar_generation_config=<model dir> (or 'none').",
                        ", ".join(c.sampling_unknown))

    async def _logprobs_mode(self, flow: http.HTTPFlow, c: calls.CapturedCall) -> str | None:
        """The upstream's logprobs mode: probed once per upstream (the first calls wait for the
        probe, at most PROBE_TIMEOUT; then they go on and record null while it finishes)."""
        opt = ctx.options.polar_logprobs_mode
        if opt != "auto":
            return None if opt == "unknown" else opt
        base = self._upstream_base(flow)
        cache = self.logprobs_modes
        if cache.should_probe(base, time.monotonic()):
            # the server's key: the option's, else the harness's own (a server started with --api-key)
            key = ctx.options.polar_server_api_key
            auth = f"Bearer {key}" if key else flow.request.headers.get("authorization")
            headers = {"Authorization": auth} if auth else {}
            cache.started(base, asyncio.ensure_future(self._probe(base, c.model, headers)))
        task = cache.entry(base).task
        if task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(task), PROBE_TIMEOUT)
            except TimeoutError:
                log.warning("polar: the logprobs-mode probe of %s takes over %.0f s: this call records null",
                            base, PROBE_TIMEOUT)
        return cache.mode(base)

    async def _probe(self, base: str, model: str | None, headers: dict[str, str]) -> None:
        generation = self.logprobs_modes.entry(base).generation
        mode = None
        try:
            mode = await asyncio.to_thread(probe_upstream, base, model, PROBE_TIMEOUT, headers)
            if mode is None:
                log.warning("polar: the logprobs-mode probe of %s could not tell processed, raw or scaled: rows "
                            "record logprobs_mode null until a later probe can (or set polar_logprobs_mode)", base)
        except Exception as exc:  # noqa: BLE001 - any failure means "unknown", retried later
            log.warning("polar: the logprobs-mode probe of %s failed (%s: %s): rows record logprobs_mode null "
                        "until a later probe succeeds", base, type(exc).__name__, exc)
        self.logprobs_modes.done(base, generation, mode, time.monotonic())

    def invalidate_logprobs_mode(self, base: str | None = None) -> None:
        """Forget the logprobs mode of upstream ``base`` (all: None); its next call probes again.
        Called after a weight sync and when a call to the upstream fails to connect."""
        self.logprobs_modes.invalidate(base)

    def _after_send(self, c: calls.CapturedCall) -> None:
        """The request's log text (secret scan), then its delta against the episode's previous
        request, packed: both off the answer's path (an episode's first call packs ~80 KB)."""
        try:
            calls.finish_request_text(c)
            if c.request_text and c.status is None:  # (no answer yet: else the row is written already)
                c.prepared_request = self.episodes.writer(c.episode_id).prepare_request(c.request_text)
        except Exception as exc:  # noqa: BLE001 - the row computes it again; never fail the call here
            log.debug("polar: request of call %s not prepared early: %s", c.call_index, exc)

    def _redirect(self, flow: http.HTTPFlow, model_call: bool = False) -> None:
        """polar_upstream: model calls and /v1/... (e.g. /v1/models) go to the inference server."""
        u = self._upstream
        if u is None or not (model_call or flow.request.path.startswith("/v1/") or flow.request.path == "/v1"):
            return
        base = u.path.rstrip("/")
        flow.request.scheme = u.scheme
        flow.request.host = u.hostname
        flow.request.port = u.port or (443 if u.scheme == "https" else 80)
        flow.request.path = base + flow.request.path
        flow.request.headers["host"] = u.netloc

    async def _dialect(self, flow: http.HTTPFlow) -> str:
        opt = ctx.options.polar_dialect
        if opt != "auto":
            return opt
        base = f"{flow.request.scheme}://{flow.request.host}:{flow.request.port}"
        d = self._auto.get(base)
        if d is None:
            found = await asyncio.to_thread(probe_dialect, base)
            d = found or "vllm"
            if found is None:
                log.warning("polar: could not tell the dialect of %s from /v1/models; using vllm", base)
            self._auto[base] = d
        return d

    async def _end_episode(self, flow: http.HTTPFlow, episode_id: str) -> None:
        """Write the end record. With calls of the episode still in flight, the end record waits
        for the last one's row (open_logs.py); the answer waits up to polar_end_wait_ms for
        that, then says 202 ``"ended": false`` (the end record still follows the last call)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def on_end(n: int) -> None:
            def settle() -> None:
                if not done.done():
                    done.set_result(n)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the loop is closed (shutdown): nobody waits any more
                pass

        try:
            reward, meta = parse_end_body(flow.request.content or b"")
            n = self.episodes.end(episode_id, reward, meta, on_end)
        except ControlRequestError as exc:
            flow.response = _error_response(400, str(exc))
            return
        except EpisodeFinished as exc:
            flow.response = _error_response(409, str(exc))
            return
        except (OSError, LogError) as exc:  # the end record is not on disk: the caller may retry
            log.error("polar: episode %s: end record not written: %s", episode_id, exc)
            flow.response = _error_response(503, f"polar proxy could not write the end record of episode "
                                                 f"{episode_id!r} ({type(exc).__name__}: {exc}); retry the end")
            return
        if n is None:
            pending = self.episodes.inflight(episode_id)
            try:
                n = await asyncio.wait_for(asyncio.shield(done), ctx.options.polar_end_wait_ms / 1000)
            except TimeoutError:
                flow.response = _json_response(202, {
                    "episode_id": episode_id, "reward": reward, "ended": False, "pending_calls": pending,
                    "message": "calls of this episode are still in flight; the end record is written "
                               "after the last one's row"})
                return
        flow.response = _json_response(200, {"episode_id": episode_id, "calls": n, "reward": reward, "ended": True})

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        c: calls.CapturedCall | None = flow.metadata.get(META)
        if c is None or flow.response is None:
            return
        c.header_weight_version = flow.response.headers.get(calls.WEIGHT_VERSION_HEADER)
        transform = calls.start_response(c, flow.response.status_code, flow.response.headers.get("content-type", ""))
        if transform is not None:
            transform.on_final = lambda: self._final(c)
            flow.response.stream = transform
            flow.response.headers.pop("content-length", None)  # the filter changes the length

    def _final(self, c: calls.CapturedCall) -> str | None:
        """A stream's final event ([DONE]) arrived: its row is written before the harness gets
        it (stream.py). Returns why the row could not be written (the harness gets an error
        event instead of [DONE]), or None."""
        calls.stream_final(c)
        return self._write(c)

    def response(self, flow: http.HTTPFlow) -> None:
        c: calls.CapturedCall | None = flow.metadata.pop(META, None)
        self._live.pop(id(flow), None)
        if c is None:
            return
        resp = flow.response
        streamed = c.transform is not None  # (then the answer is on its way: a failed row is told at [DONE])
        try:
            if streamed:
                calls.finish_stream(c)
            else:
                try:
                    body = resp.content or b""
                except ValueError:
                    body = resp.raw_content or b""
                new = calls.finish_body(c, resp.status_code, body)
                if new is not None:
                    if c.reply is not None:  # a translated error answer
                        resp.status_code, resp.headers["content-type"] = c.reply
                    resp.content = new
        except Exception as exc:  # noqa: BLE001 - (a bug) the call still gets its row and leaves the in-flight count
            log.exception("polar: call %s of episode %s", c.call_index, c.episode_id)
            c.errors.append(f"polar proxy failed to process the answer ({type(exc).__name__}: {exc})")
        failed = self._write(c)
        if failed is not None and not streamed:
            flow.response = _api_error(c, 503, failed)  # not recorded: never answered as a success
        if c.trash:  # freed once the answer is on its way (not SIGKILL-relevant: the row is written)
            asyncio.get_running_loop().call_soon(c.drop_trash)

    def error(self, flow: http.HTTPFlow) -> None:
        c: calls.CapturedCall | None = flow.metadata.pop(META, None)
        self._live.pop(id(flow), None)
        if c is None:
            return
        msg = flow.error.msg if flow.error else "unknown error"
        where = "mid-stream" if c.transform is not None else "before a response"
        if c.status is None:  # no answer at all: the server may have restarted (another mode)
            self.invalidate_logprobs_mode(self._upstream_base(flow))
        calls.finish_stream(c, error=msg)
        self._write(c, error=f"connection failed {where}: {msg}")

    def _write(self, c: calls.CapturedCall, error: str | None = None) -> str | None:
        """Write the call's rows (once). Returns None when they are on disk, else why not: the
        caller must not answer the call as a success (the episode is marked incomplete)."""
        if c.written:
            return None
        c.written = True
        failed = None
        try:
            rows = calls.rows(c, time.time(), error)
            self.episodes.record(c.episode_id, c.call_index, rows)
        except (OSError, LogError) as exc:
            log.error("polar: could not log call %s of episode %s: %s", c.call_index, c.episode_id, exc)
            failed = _storage_message(exc)
        except Exception as exc:  # noqa: BLE001 - never take the proxy down for one row
            log.exception("polar: could not log call %s of episode %s", c.call_index, c.episode_id)
            failed = f"polar proxy could not record this call ({type(exc).__name__}: {exc})"
        finally:
            if c.weight_ticket is not None:  # (after its row: a sync's drain waits for it)
                c.weight_hold.finish(c.weight_ticket)
            try:
                self.episodes.call_done(c.episode_id)  # may write a deferred end record
            except Exception as exc:  # noqa: BLE001
                log.error("polar: could not end episode %s: %s", c.episode_id, exc)
        return failed

    def done(self) -> None:
        # Calls still in flight (a stream SIGTERM interrupted) get their rows first: a pending end
        # record must follow them, and the flows' error hooks run after this (nothing left then).
        for flow in list(self._live.values()):
            c = flow.metadata.pop(META, None)
            if c is None:
                continue
            msg = "polar proxy shut down"
            where = "mid-stream" if c.transform is not None else "before a response"
            calls.finish_stream(c, error=msg)
            self._write(c, error=f"connection failed {where}: {msg}")
        self._live.clear()
        if self.episodes is not None:
            self.episodes.close_all()


addons = [PolarAddon(), Tuning(), FastDispatch()]
