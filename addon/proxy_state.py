"""What the proxy's addons share (addon/polar_addon.py composes them): the episode logs, the
upstream and its weight gate, what each upstream server is (upstream.Upstreams: dialect, sampling
defaults, logprobs mode), the control secret, the credentials to scrub from logs, and the answers
the proxy gives itself.

One instance per proxy process; each addon (access.py, control_plane.py, weight_sync.py,
model_calls.py) holds it and owns the options of its own concern.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse

from mitmproxy import ctx, http

from addon.open_logs import Episodes
from addon.redact import Credentials
from addon.refused import RefusedLog
from addon.upstream import Upstreams
from addon.weight_hold import UpstreamWeights

log = logging.getLogger("polar")

ROUTE = "polar_route"  # flow.metadata key: the request's routing.Route, set by access.Access
DECODED_BODY = "polar_decoded_body"  # flow.metadata: a compressed request body, decoded within its bound (access.py)
CALL = "polar_call"  # flow.metadata key: the model call being captured (call.CallState)


def json_response(status: int, obj: dict) -> http.Response:
    return http.Response.make(status, json.dumps(obj).encode(), {"content-type": "application/json"})


def error_response(status: int, message: str, kind: str = "polar_proxy_error") -> http.Response:
    return json_response(status, {"error": {"message": message, "type": kind, "code": status}})


class ProxyState:
    def __init__(self) -> None:
        self.episodes: Episodes | None = None
        self.upstream: urllib.parse.SplitResult | None = None  # option polar_upstream
        self.secret: str | None = None  # the control secret (None: an open control plane)
        self.credentials = Credentials()  # scrubbed by value from every log (redact.py)
        self.refused = RefusedLog()  # LOGDIR/refused.jsonl
        self.weights_of: dict[str, UpstreamWeights] = {}  # each upstream's gate and version (weight_hold.py)
        self.weights_lock: asyncio.Lock | None = None
        self.upstreams = Upstreams()  # each upstream server's identity (upstream.py)

    def upstream_base(self, flow: http.HTTPFlow) -> str:
        u = self.upstream
        if u is not None:
            return f"{u.scheme}://{u.hostname}:{u.port or (443 if u.scheme == 'https' else 80)}{u.path.rstrip('/')}"
        r = flow.request
        return f"{r.scheme}://{r.host}:{r.port}"

    def server_headers(self) -> dict[str, str]:
        """The headers of the proxy's own requests to the server (version reads, syncs, probes):
        its configured key only. Never a caller's Authorization: whoever called @weights (or made
        the first model call) would choose the credential of the proxy's privileged requests."""
        key = ctx.options.polar_server_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def weights(self, base: str) -> UpstreamWeights:
        """The upstream's gate, its kind and version learned at first contact (asked again every
        DETECT_RETRY_S while unknown)."""
        uw = self.weights_of.get(base)
        if uw is not None and (uw.kind is not None or time.monotonic() < uw.detect_retry_at):
            return uw
        if self.weights_lock is None:
            self.weights_lock = asyncio.Lock()
        async with self.weights_lock:  # one probe per upstream, however many calls arrive at once
            uw = self.weights_of.get(base)
            if uw is not None and uw.kind is None and time.monotonic() >= uw.detect_retry_at:
                await uw.detect(ctx.options.polar_server_kind)
            if uw is None:
                uw = UpstreamWeights(base, None, None, headers=self.server_headers(), logdir=ctx.options.polar_logdir,
                                     scrub=self.credentials.scrubber)
                await uw.detect(ctx.options.polar_server_kind)
                self.weights_of[base] = uw
        return uw

    def invalidate_logprobs_mode(self, base: str | None = None) -> None:
        """Forget the logprobs mode of upstream ``base`` (all: None); its next call probes again.
        Called after a weight sync and when a call to the upstream fails to connect."""
        self.upstreams.forget_logprobs_mode(base)
