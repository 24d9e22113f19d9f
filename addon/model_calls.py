"""Model calls: capture each call's token ids and logprobs into its episode's log (the mitmproxy
addon ``ModelCalls``).

access.py has already decided the request is a model-API call of a known episode (or the model
listing) and may pass; this addon learns what the upstream is (upstream.py: its dialect, sampling
defaults and logprobs mode), rewrites the request (call.py: the flags that return ids), waits while
a weight sync holds the upstream (weight_hold.py), and writes the call's rows when the answer is
complete. The protocol logic lives in sans-IO modules (server_dialects, sse, stream, chat,
completions, call, call_tokens, redact); episode files in open_logs.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import urllib.parse

from mitmproxy import ctx, exceptions, http
from mitmproxy.addonmanager import Loader

from addon import call as calls
from addon.applied_sampling import GenerationConfigError, load_generation_config
from addon.idlists import PromptCache
from addon.logprobs_probe import PROBE_TIMEOUT
from addon.open_logs import MAX_EPISODES, MAX_OPEN, EpisodeFinished, Episodes, TooManyEpisodes
from addon.proxy_state import CALL, DECODED_BODY, ROUTE, ProxyState, error_response
from addon.redact import CleanRequests, credential_values
from addon.routing import CHAT_PATH, MODEL, MODELS, RouteError, api_of, check_episode_id
from addon.server_dialects import DIALECTS
from addon.upstream import LOGPROBS_MODES, RECHECK_S, Upstreams
from addon.weight_hold import HoldTimeout
from polar_contracts.log.table import LogError
from polar_contracts.log.writer import warm_up
from polar_contracts.translate import TranslationError, translator_for

log = logging.getLogger("polar")
META = CALL
MAX_EPISODE_CALLS = 64  # default of polar_max_episode_calls: harnesses run a few calls at once (subagents)


def _api_error(c: calls.CallState, status: int, message: str) -> http.Response:
    """An answer the proxy gives itself, in the harness's API's error shape."""
    if c.translator is not None:
        body, ctype = c.translator.error_body(status, message)
        return http.Response.make(status, body, {"content-type": ctype})
    return error_response(status, message)


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


def check_logdir(logdir: str) -> str:
    """The log directory, created if missing, as its real path (a symlink swapped later does not
    move the logs); OptionsError when it cannot be used."""
    if not logdir:
        raise exceptions.OptionsError("polar_logdir is required: --set polar_logdir=DIR")
    try:
        os.makedirs(logdir, exist_ok=True)
    except OSError as exc:
        raise exceptions.OptionsError(f"polar_logdir {logdir!r} cannot be created: {exc}") from None
    real = os.path.realpath(logdir)
    if not os.path.isdir(real):
        raise exceptions.OptionsError(f"polar_logdir {logdir!r} is not a directory")
    if not os.access(real, os.W_OK):
        raise exceptions.OptionsError(f"polar_logdir {logdir!r} is not writable")
    mode = os.stat(real).st_mode
    if mode & 0o002 and not mode & 0o1000:
        raise exceptions.OptionsError(f"polar_logdir {logdir!r} is world-writable without the sticky bit: anyone "
                                      f"could plant or replace episode logs there (chmod o-w)")
    return real


class ModelCalls:
    """The mitmproxy addon that captures model calls: its options, and the hooks that carry each
    call's call.CallState from its request to its rows."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.prompt_cache = PromptCache()  # each episode's last prompt id list (idlists.py)
        # each episode's last request without secret keys (redact.py): the next scan reads the change
        self.clean_requests = CleanRequests(calls.SECRET_KEY_RE, calls.SECRET_MATCH_MAX)
        # flows with a call in flight (SIGTERM: their rows go in before the pending end records)
        self._live: dict[int, http.HTTPFlow] = {}

    @property
    def episodes(self) -> Episodes | None:
        return self.state.episodes

    @property
    def upstreams(self) -> Upstreams:
        """What each upstream server is (upstream.py), shared with the other addons (weight syncs
        forget logprobs modes)."""
        return self.state.upstreams

    # -- options ----------------------------------------------------------------------------------
    def load(self, loader: Loader) -> None:
        loader.add_option("polar_logdir", str, "", "Directory for episode logs (<episode_id>.arrow). Required.")
        loader.add_option("polar_dialect", str, "auto",
                          "Inference server dialect: vllm | sglang | auto (ask the server's /v1/models owned_by).")
        loader.add_option("polar_episode", str, "default",
                          "Episode of calls with no x-polar-episode header and no /polar/<id>/ path prefix "
                          "(without a control secret only: with one, every call must name its capability).")
        loader.add_option("polar_upstream", str, "",
                          "Forward-proxy mode: send model calls (/v1/..., /polar/...) to this server URL "
                          "whatever host the harness names, e.g. http://127.0.0.1:8000.")
        loader.add_option("polar_fsync", bool, False, "fsync each log row (survives power loss, slower).")
        loader.add_option("polar_max_open_logs", int, MAX_OPEN,
                          "At most this many episode logs hold an open file descriptor; the least recently "
                          "used are closed and reopened on their next row (episodes never ended cost no fd).")
        loader.add_option("polar_max_episodes", int, MAX_EPISODES,
                          "At most this many episodes are open (started, not ended) on this proxy: a call or end "
                          "for a new episode beyond it is answered 503 and makes no log file.")
        loader.add_option("polar_max_episode_calls", int, MAX_EPISODE_CALLS,
                          "Refuse (429) a model call of an episode that already has this many calls in flight "
                          "(one episode cannot take the proxy's capacity from the others).")
        loader.add_option("polar_max_choices", int, calls.MAX_CHOICES,
                          "Refuse (400) a call asking for more than this many choices (n): each is a log row.")
        loader.add_option("polar_generation_config", str, "",
                          "The served model's directory or its generation_config.json: the sampling defaults the "
                          "server applies to fields a request leaves unset. The proxy then writes them into the "
                          "request it forwards and records them on each row (temperature, top_p, top_k, min_p). "
                          "'none': the server applies no model defaults (vLLM --generation-config vllm). Unset: "
                          "the proxy asks each upstream which model it serves (vLLM /v1/models root, SGLang "
                          "/model_info model_path) and reads that directory's generation_config.json when it can; "
                          "else such fields are recorded as unknown (null), the row's sampling_source saying why.")
        loader.add_option("polar_logprobs_mode", str, "auto",
                          "What the upstream's logprobs are, recorded on each row: auto (probe each upstream once "
                          "before its first call, again after a weight sync or a failed connection) | processed | "
                          "raw | scaled | unknown (no probe; recorded null).")
        loader.add_option("polar_identity_recheck_s", int, RECHECK_S,
                          "When the proxy opens a new connection to the upstream and learned its identity (dialect, "
                          "sampling defaults, logprobs mode) more than this many seconds ago, it learns it again "
                          "before the call: a server restarted with other flags between calls is noticed. 0: at "
                          "every new connection; negative: never.")
        loader.add_option("polar_probe_timeout_s", float, PROBE_TIMEOUT,
                          "Seconds each logprobs-mode probe request may take. The first calls to an upstream wait "
                          "for its probe (a row is never written before its mode is known); a probe that fails or "
                          "times out records null, with a warning, and is retried later.")

    def configure(self, updated: set[str]) -> None:
        o = ctx.options
        ups = self.upstreams
        if "polar_probe_timeout_s" in updated:
            if not o.polar_probe_timeout_s > 0:
                raise exceptions.OptionsError(f"polar_probe_timeout_s must be > 0 seconds, not {o.polar_probe_timeout_s}")
            ups.probe_timeout_s = o.polar_probe_timeout_s
        if "polar_identity_recheck_s" in updated:
            ups.recheck_s = o.polar_identity_recheck_s
        if "polar_dialect" in updated:
            if o.polar_dialect not in (*DIALECTS, "auto"):
                raise exceptions.OptionsError(f"polar_dialect must be vllm, sglang or auto, not {o.polar_dialect!r}")
            ups.dialect_option = o.polar_dialect
        if "polar_episode" in updated:
            try:
                check_episode_id(o.polar_episode, "option polar_episode")
            except RouteError as exc:
                raise exceptions.OptionsError(str(exc)) from None
        for name in ("polar_max_open_logs", "polar_max_choices", "polar_max_episodes", "polar_max_episode_calls"):
            if name in updated and getattr(o, name) < 1:
                raise exceptions.OptionsError(f"{name} must be >= 1, not {getattr(o, name)}")
        if "polar_max_open_logs" in updated and self.episodes is not None:
            self.episodes.max_open = o.polar_max_open_logs
        if "polar_max_episodes" in updated and self.episodes is not None:
            self.episodes.max_episodes = o.polar_max_episodes
        if "polar_generation_config" in updated:
            ups.sampling_option = None
            if o.polar_generation_config:
                try:
                    ups.sampling_option = load_generation_config(o.polar_generation_config)
                except GenerationConfigError as exc:
                    raise exceptions.OptionsError(str(exc)) from None
        if "polar_logprobs_mode" in updated:
            if o.polar_logprobs_mode not in LOGPROBS_MODES:
                raise exceptions.OptionsError("polar_logprobs_mode must be auto, processed, raw, scaled or unknown, "
                                              f"not {o.polar_logprobs_mode!r}")
            ups.logprobs_mode_option = o.polar_logprobs_mode
            ups.forget_logprobs_mode()
        if "polar_upstream" in updated:
            ups.forget()  # another server: its identity is learned again
            self.state.upstream = None
            if o.polar_upstream:
                u = urllib.parse.urlsplit(o.polar_upstream)
                if u.scheme not in ("http", "https") or not u.hostname:
                    raise exceptions.OptionsError(f"polar_upstream must be an http(s) URL, not {o.polar_upstream!r}")
                self.state.upstream = u
        if "polar_logdir" in updated or "polar_fsync" in updated:
            logdir = check_logdir(o.polar_logdir)
            if self.episodes is not None:
                self.episodes.close_all()
            self.state.episodes = Episodes(logdir, fsync=o.polar_fsync, max_open=o.polar_max_open_logs,
                                           max_episodes=o.polar_max_episodes)
            warm_up()

    # -- hooks ------------------------------------------------------------------------------------
    async def request(self, flow: http.HTTPFlow) -> None:
        r = flow.metadata.get(ROUTE)
        if flow.response is not None or r is None or r.kind not in (MODEL, MODELS):
            return  # (answered, refused by access.py, or another addon's concern)
        req = flow.request
        path = req.path = r.path  # the /polar/<capability>/ prefix stripped
        api = api_of(req.method, path)
        translator = translator_for(req.method, path) if api is None else None
        model_call = api is not None or translator is not None
        self._redirect(flow)
        if not model_call:
            return  # GET /v1/models: forwarded, not logged
        if translator is not None:
            api = translator.api
        heads = few_headers(req.headers)
        t_start = time.time()
        busy = self.episodes.inflight(r.episode_id)
        if busy >= ctx.options.polar_max_episode_calls:
            flow.response = error_response(429, f"episode {r.episode_id!r} already has {busy} calls in flight; this "
                                                f"proxy serves at most {ctx.options.polar_max_episode_calls} at once "
                                                f"per episode (option polar_max_episode_calls)")
            return
        try:
            _, call_index = self.episodes.begin_call(r.episode_id)  # counted in flight until _write
        except EpisodeFinished as exc:
            flow.response = error_response(409, f"{exc}; use a new episode id for new calls")
            return
        except TooManyEpisodes as exc:
            flow.response = error_response(503, str(exc))
            return
        except (OSError, LogError) as exc:  # the log cannot be opened: never forward a call unrecorded
            log.error("polar: episode %s: %s", r.episode_id, exc)
            flow.response = error_response(503, _storage_message(exc))
            return
        try:
            if not flow.server_conn.connected:  # (lazy connection strategy: this call opens a new connection)
                self.upstreams.connecting(f"{req.host}:{req.port}", time.monotonic())
            dialect = await self.upstreams.dialect(f"{req.scheme}://{req.host}:{req.port}")
            c = calls.CallState(r.episode_id, call_index, api, dialect, t_start, b"")
            c.translator = translator
            c.prompt_cache = self.prompt_cache
            c.clean_requests = self.clean_requests
            c.max_choices = ctx.options.polar_max_choices
            c.header_secrets = credential_values(req.headers.fields, path)
            self.state.credentials.learn(c.header_secrets)
            c.known = self.state.credentials.scrubber((r.mac,) if r.mac else ())
            base, asking = self.state.upstream_base(flow), self._probe_headers(flow)
            c.sampling_defaults, c.sampling_unknown_why = await self.upstreams.sampling_defaults(base, dialect, asking)
            ok = self._prepare(flow, c, heads)
            if ok:
                ok = await self._gate(flow, c)
            if ok:
                self.upstreams.warn_unknown_sampling(c.sampling_unknown, c.sampling_unknown_why)
                c.logprobs_mode = await self.upstreams.logprobs_mode(base, c.model, asking)
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

    def _prepare(self, flow: http.HTTPFlow, c: calls.CallState, heads: dict[str, str]) -> bool:
        """Rewrite the request; False when the proxy answered it itself (the row is final)."""
        req = flow.request
        encoded = heads.get("content-encoding", "identity").lower() not in ("", "identity")
        try:
            # (a compressed body was decoded within polar_max_body by access.py; else it did not decode)
            raw = flow.metadata.pop(DECODED_BODY, None) if encoded else req.raw_content
            if raw is None and req.raw_content:
                raise ValueError(f"content-encoding {heads.get('content-encoding')!r}: the body does not decode")
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
        except RecursionError:  # (body_shape.py bounds the depth first; kept so that it is never a 500)
            exc = calls.RequestRefused("request body nests JSON too deeply to be read")
            c.errors.append(f"request refused by the proxy: {exc}")
            c.status = 400
            flow.response = _api_error(c, 400, str(exc))
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
                flow.response = error_response(500, msg)
            return False
        if new is not None:
            if encoded or "transfer-encoding" in heads:
                req.content = new  # re-encodes what the harness compressed; keeps its framing
            else:  # (what set_content does here, without reading the headers again)
                req.raw_content = new
                req.headers["content-length"] = str(len(new))
            if c.translator is not None:
                up = self.state.upstream
                req.path = (up.path.rstrip("/") if up else "") + CHAT_PATH
                req.headers["content-type"] = "application/json"
            # the transforms parse the answer: ask for it uncompressed (the harness still decodes it)
            req.headers["accept-encoding"] = "identity"
        return True

    async def _gate(self, flow: http.HTTPFlow, c: calls.CallState) -> bool:
        """Wait while a weight sync holds the upstream; False when the proxy answered (503)."""
        uw = await self.state.weights(self.state.upstream_base(flow))
        try:
            c.weight_ticket = await uw.enter(ctx.options.polar_sync_hold_max_ms / 1000)
        except HoldTimeout as exc:
            c.errors.append(str(exc))
            c.status = 503
            flow.response = error_response(503, str(exc))
            return False
        c.weight_hold = uw
        return True

    def _probe_headers(self, flow: http.HTTPFlow) -> dict[str, str]:
        """The headers of the proxy's identity requests to the upstream (upstream.py): the server's
        key, the option's, else the harness's own (a discovery or probe is one more model-API
        request on the harness's behalf, to a server started with --api-key; never a privileged
        one)."""
        key = ctx.options.polar_server_api_key
        auth = f"Bearer {key}" if key else flow.request.headers.get("authorization")
        return {"Authorization": auth} if auth else {}

    def _after_send(self, c: calls.CallState) -> None:
        """The request's log text (secret scan), then its delta against the episode's previous
        request, packed: both off the answer's path (an episode's first call packs ~80 KB)."""
        try:
            calls.finish_request_text(c)
            if c.request_text and c.status is None:  # (no answer yet: else the row is written already)
                c.prepared_request = self.episodes.writer(c.episode_id).prepare_request(c.request_text)
        except Exception as exc:  # noqa: BLE001 - the row computes it again; never fail the call here
            log.debug("polar: request of call %s not prepared early: %s", c.call_index, exc)

    def _redirect(self, flow: http.HTTPFlow) -> None:
        """polar_upstream: the model calls and the model listing (all that access.py lets through)
        go to the inference server, whatever host the harness named."""
        u = self.state.upstream
        if u is None:
            return
        base = u.path.rstrip("/")
        flow.request.scheme = u.scheme
        flow.request.host = u.hostname
        flow.request.port = u.port or (443 if u.scheme == "https" else 80)
        flow.request.path = base + flow.request.path
        flow.request.headers["host"] = u.netloc

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        c: calls.CallState | None = flow.metadata.get(META)
        if c is None or flow.response is None:
            return
        c.header_weight_version = flow.response.headers.get(calls.WEIGHT_VERSION_HEADER)
        transform = calls.start_response(c, flow.response.status_code, flow.response.headers.get("content-type", ""))
        if transform is not None:
            transform.on_final = lambda: self._final(c)
            flow.response.stream = transform
            flow.response.headers.pop("content-length", None)  # the filter changes the length

    def _final(self, c: calls.CallState) -> str | None:
        """A stream's final event ([DONE]) arrived: its row is written before the harness gets
        it (stream.py). Returns why the row could not be written (the harness gets an error
        event instead of [DONE]), or None."""
        calls.stream_final(c)
        return self._write(c)

    def response(self, flow: http.HTTPFlow) -> None:
        c: calls.CallState | None = flow.metadata.pop(META, None)
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

    def server_connected(self, data) -> None:
        """mitmproxy opened a connection to a server (eagerly, before the request, in reverse mode):
        a server restarted since the last connection may be another (upstream.py)."""
        host, port = data.server.address[:2] if data.server.address else (None, None)
        if host is not None:
            self.upstreams.connecting(f"{host}:{port}", time.monotonic())

    def error(self, flow: http.HTTPFlow) -> None:
        c: calls.CallState | None = flow.metadata.pop(META, None)
        self._live.pop(id(flow), None)
        if c is None:
            return
        msg = flow.error.msg if flow.error else "unknown error"
        where = "mid-stream" if c.transform is not None else "before a response"
        if c.status is None:  # no answer at all: the server may have restarted (another mode)
            self.upstreams.forget_logprobs_mode(self.state.upstream_base(flow))
        calls.finish_stream(c, error=msg)
        self._write(c, error=f"connection failed {where}: {msg}")

    def _write(self, c: calls.CallState, error: str | None = None) -> str | None:
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


