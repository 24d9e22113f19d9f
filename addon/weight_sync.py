"""Weight syncs through the proxy: ``GET/POST /polar/@weights``, ``POST /polar/@weights/hold`` and
``/release`` (mitmproxy addon; the protocol in polar_contracts/control.py, the gate and the
server's routes in weight_hold.py and server_weights.py).

Answered here, never forwarded (access.py has checked the control secret). The proxy's own
requests to the server carry the key of option ``polar_server_api_key`` and nothing else: never
the Authorization header of whoever called @weights.
"""
from __future__ import annotations

from mitmproxy import ctx, exceptions, http

from addon.access import Access, fail_closed
from addon.proxy_state import ROUTE, ProxyState, error_response, json_response
from addon.routing import WEIGHTS
from addon.server_weights import KINDS as SERVER_KINDS
from addon.weight_hold import UpstreamWeights
from polar_contracts.control import (
    HOLD_PATH,
    RELEASE_PATH,
    SYNC_PATH,
    ControlRequestError,
    parse_hold_body,
    parse_release_body,
    parse_sync_request,
)


class WeightSync:
    def __init__(self, state: ProxyState, access: Access) -> None:
        self.state = state
        self.access = access

    def load(self, loader) -> None:
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
                          "reads, weight syncs, the logprobs probe). Empty: none. Never a caller's Authorization "
                          "header. Scrubbed from every log.")

    def configure(self, updated) -> None:
        o = ctx.options
        if updated & {"polar_server_kind", "polar_sync_hold_max_ms", "polar_sync_drain_ms"}:
            if o.polar_server_kind not in (*SERVER_KINDS, "auto"):
                raise exceptions.OptionsError(f"polar_server_kind must be one of {', '.join(SERVER_KINDS)} or auto, "
                                              f"not {o.polar_server_kind!r}")
            for name in ("polar_sync_hold_max_ms", "polar_sync_drain_ms"):
                if getattr(o, name) < 0:
                    raise exceptions.OptionsError(f"{name} must be >= 0, not {getattr(o, name)}")
        if "polar_server_api_key" in updated:
            self.state.credentials.configure("upstream api key", o.polar_server_api_key)
        if updated & {"polar_server_kind", "polar_server_api_key", "polar_upstream", "polar_logdir"}:
            self.state.weights_of = {}  # learned again at the next call

    async def request(self, flow: http.HTTPFlow) -> None:
        r = flow.metadata.get(ROUTE)
        if flow.response is not None or r is None or r.kind != WEIGHTS:
            return
        try:
            await self._endpoint(flow, r.endpoint)
        except Exception as exc:  # noqa: BLE001 - fail closed: answered, never forwarded
            fail_closed(self.access, flow, "weight sync request", exc)
        if flow.response is None:
            self.access.refuse(flow, 500, "polar proxy gave no answer to this weight sync request; it was not "
                                          "forwarded")

    async def _endpoint(self, flow: http.HTTPFlow, endpoint: str) -> None:
        """GET /polar/@weights: the upstream's version; POST: a weight sync; POST .../hold and
        .../release: this proxy's part in a sync another proxy of the same server runs
        (weight_hold.py)."""
        req = flow.request
        if req.method not in ("GET", "POST") or (req.method == "GET" and endpoint != SYNC_PATH):
            flow.response = error_response(405, f"{endpoint} accepts {'GET and ' if endpoint == SYNC_PATH else ''}"
                                                f"POST, not {req.method}")
            return
        base = self.state.upstream_base(flow)
        uw = await self.state.weights(base)
        if req.method == "GET":
            flow.response = json_response(200, uw.info())
            return
        try:
            if endpoint == HOLD_PATH:
                version, lease_s = parse_hold_body(req.content or b"")
                status, answer = await uw.hold_for_peer(version, ctx.options.polar_sync_drain_ms / 1000, lease_s)
            elif endpoint == RELEASE_PATH:
                version, after, ok = parse_release_body(req.content or b"")
                status, answer = uw.release_peer(version, after, ok)
                if status == 200:
                    self.state.invalidate_logprobs_mode(base)  # new weights
            else:
                path, version, peers_drained = parse_sync_request(req.content or b"")
                status, answer = await self._sync(base, uw, path, version, peers_drained)
        except ControlRequestError as exc:
            self.access.refuse(flow, exc.status, str(exc))
            return
        if status != 200:
            answer = {**answer, "error": {"message": answer["error"], "type": "polar_weight_sync_error",
                                          "code": status}}
        flow.response = json_response(status, answer)

    async def _sync(self, base: str, uw: UpstreamWeights, path: str, version: str,
                    peers_drained: bool) -> tuple[int, dict]:
        if uw.kind is None:  # the server may have come up since the first call: ask again
            await uw.detect(ctx.options.polar_server_kind)
        status, answer = await uw.sync(path, version, ctx.options.polar_sync_drain_ms / 1000, peers_drained)
        self.state.invalidate_logprobs_mode(base)  # new weights, maybe a restarted server
        return status, answer
