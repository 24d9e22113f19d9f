"""The I/O around weight_gate.py: model calls wait at the gate (asyncio), a sync talks to the
server (server_weights.py's steps over HTTP) and every attempt is appended to
``LOGDIR/weight-syncs.jsonl`` (JSON lines, not an .arrow file: recon reads only episode logs).

``POST /polar/@weights`` (``@`` cannot be in an episode id, so the path never collides with
``/polar/<episode_id>/...``) with ``{"path": DIR, "version": V}``: hold new calls, drain the calls
in flight (``polar_sync_drain_ms``), have the server load DIR as V, record V, release the held
calls, answer ``{"weight_version": V, "previous_version", "server_kind", "seconds": {...},
"held_calls", "spanned_calls"}``. A failed sync answers 502 with the reason and the version the
server still serves; the held calls are released either way. ``GET /polar/@weights``: the
upstream's kind, version and state.

Several proxies in front of one server (harness_recipes/node/proxies.py) sync as one: every proxy
but one gets ``POST /polar/@weights/hold`` ``{"version": V, "lease_s": S}`` (hold, drain, then
count as loading: calls still in flight span), the remaining one the ordinary sync above with
``"peers_drained"`` (so a server whose pause differs for a drained engine is told the truth), and
the held ones ``POST /polar/@weights/release`` ``{"version": V, "weight_version": W, "ok": B}``
with what that sync answered. The server loads once; no proxy admits a call while it loads. A held
proxy whose release never comes (the coordinator died) releases itself after ``lease_s`` with the
version the server reports then.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from typing import Any

from polar_contracts.log.table import LogError
from polar_contracts.log.writer import append_line
from polar_contracts.weight_versions import proxy_version, unknown

from .server_weights import (
    ATOMIC,
    KINDS,
    PROBE_ORDER,
    VERSION_PATH,
    check_step,
    parse_version_answer,
    sync_steps,
)
from .weight_gate import SERVING, GateBusy, Ticket, WeightGate

log = logging.getLogger("polar")
SYNC_LOG = "weight-syncs.jsonl"
DETECT_RETRY_S = 30.0  # an upstream whose version could not be read is asked again after this
# This proxy process's start, in the versions it names itself (polar_contracts/weight_versions.py
# proxy_version): UTC time and pid, so two proxies (or one restarted) never share a name.
PROXY_START = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.{os.getpid()}"

# (method, url, json body or None, headers, timeout) -> (status, body)
Http = Callable[[str, str, Any, dict, float], Awaitable[tuple[int, bytes]]]


class HoldTimeout(Exception):
    """A call waited at the gate longer than polar_sync_hold_max_ms."""


async def urllib_http(method: str, url: str, body: Any, headers: dict, timeout: float) -> tuple[int, bytes]:
    """One HTTP request on a worker thread (stdlib only: the proxy's own loop keeps serving)."""
    def go() -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        h = dict(headers, **({"Content-Type": "application/json"} if data is not None else {}))
        req = urllib.request.Request(url, data=data, headers=h, method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
    return await asyncio.to_thread(go)


class UpstreamWeights:
    """The gate of one upstream server, its kind, and the syncs through it."""

    def __init__(self, base: str, kind: str | None, version: str | None, *, http: Http = urllib_http,
                 headers: dict | None = None, logdir: str | None = None, timeout: float = 600.0,
                 scrub: Callable[[], Callable[[str], str]] | None = None):
        self.base = base.rstrip("/")
        self.scrub = scrub  # () -> a scrubber of the credentials the proxy knows (redact.Credentials)
        self.kind = kind
        self.gate = WeightGate(version)
        self.http = http
        self.headers = headers or {}  # the server's API key, if any: never logged
        self.logdir = logdir
        self.timeout = timeout
        # Where the weights the server serves now live (for a server whose failed load is not
        # atomic, the proxy loads them again): vLLM's model card ``root`` at first contact, then
        # the path of each good sync.
        self.good_path: str | None = None
        self._recovery: dict | None = None  # the failed sync's attempt to load good_path again
        self.detect_retry_at = 0.0  # (monotonic) when detect may run again while the kind is unknown
        self._changed = asyncio.Event()
        self._peer: dict | None = None  # the hold another proxy's sync asked for (hold_for_peer)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _until(self, pred: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not pred():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return pred()
        return True

    # -- model calls ------------------------------------------------------------------------------
    async def enter(self, hold_max_s: float) -> Ticket:
        """A ticket for one model call; waits while a sync holds the gate (HoldTimeout after hold_max_s)."""
        t = self.gate.admit()
        if t is not None:
            return t
        target = self.gate.target
        self.gate.waiting += 1
        try:
            ok = await self._until(lambda: self.gate.state == SERVING, hold_max_s)
        finally:
            self.gate.waiting -= 1
        t = self.gate.admit() if ok else None
        if t is None:
            raise HoldTimeout(f"the call waited {hold_max_s:g} s at the proxy while the weight sync to version "
                              f"{target!r} ran ({self.gate.state}); it was not sent to the server "
                              f"(polar_sync_hold_max_ms bounds the wait)")
        return t

    def finish(self, t: Ticket) -> None:
        self.gate.finish(t)
        self._signal()

    # -- versions ---------------------------------------------------------------------------------
    async def read_version(self, kind: str | None = None, timeout: float = 30.0) -> str:
        kind = kind or self.kind
        status, body = await self.http("GET", self.base + VERSION_PATH[kind], None, self.headers, timeout)
        return parse_version_answer(kind, status, body)

    async def detect(self, kind_option: str) -> None:
        """Learn the server's kind (option, else the first version endpoint that answers) and its
        current version. Unknown: both stay None, the reason is logged, and the proxy asks again
        on a call after DETECT_RETRY_S (the server may not have been up yet)."""
        kinds = PROBE_ORDER if kind_option == "auto" else (kind_option,)
        reasons = []
        self.detect_retry_at = time.monotonic() + DETECT_RETRY_S
        for k in kinds:
            try:
                v = await self.read_version(k, timeout=5.0)
            except Exception as exc:  # noqa: BLE001 - each failure is one reason in the warning
                reasons.append(f"{k}: {exc}"[:300])
                continue
            self.kind, self.gate.version = k, v
            if not ATOMIC[k]:
                self.good_path = await self._model_root()
            log.info("polar: upstream %s is %s, serving weight_version %r", self.base, k, v)
            return
        self._name_unnamed()
        log.warning("polar: cannot learn the weight version of %s (polar_server_kind=%s): %s. Rows carry the "
                    "proxy's own version %r and weight syncs through the proxy are refused; for real vLLM start it "
                    "with VLLM_SERVER_DEV_MODE=1", self.base, kind_option, "; ".join(reasons), self.gate.version)

    def _name_unnamed(self) -> None:
        """A server that names no version: the proxy's own name for its weights (weight_versions.py)."""
        if self.gate.version is None:
            self.gate.version = proxy_version(PROXY_START, self.gate.syncs)

    async def _model_root(self) -> str | None:
        try:
            status, body = await self.http("GET", self.base + "/v1/models", None, self.headers, 30.0)
            root = json.loads(body)["data"][0].get("root") if status == 200 else None
        except Exception:  # noqa: BLE001 - no recovery path then (the failure marker still protects rows)
            return None
        return root if isinstance(root, str) else None

    # -- a sync -----------------------------------------------------------------------------------
    async def sync(self, path: str, version: str, drain_s: float, peers_drained: bool = True) -> tuple[int, dict]:
        """(HTTP status, answer) of one sync to ``version``; never raises for a server failure.
        ``peers_drained`` false: other proxies in front of this server still have calls in flight."""
        if self.kind not in KINDS:
            return 503, {"error": f"the proxy does not know what server {self.base} is (no weight version "
                                  f"endpoint answered); set polar_server_kind, or start vLLM with "
                                  f"VLLM_SERVER_DEV_MODE=1"}
        try:
            self.gate.hold(version)
        except GateBusy as exc:
            return 409, {"error": str(exc)}
        before = self.gate.version
        t0 = time.time()
        self._signal()
        rec: dict[str, Any] = {"upstream": self.base, "server_kind": self.kind, "previous_version": before,
                               "target_version": version, "path": path, "t_request": t0, "steps": []}
        error, after, spanned = None, before, []
        self._recovery = None
        load_tried = False
        try:
            drained = await self._until(lambda: self.gate.drained, drain_s)
            rec["drained"], rec["t_drained"] = drained, time.time()
            if not peers_drained:
                rec["peers_drained"] = False
            spanned = self.gate.load()
            for step in sync_steps(self.kind, path, version, drained and peers_drained):
                if error is not None and not step.always:
                    continue
                t = time.time()
                try:
                    status, body = await self.http(step.method, self.base + step.path, step.body, self.headers,
                                                   self.timeout)
                    why = check_step(self.kind, step, status, body)
                except Exception as exc:  # noqa: BLE001 - a connection failure is this step's failure
                    status, why = None, f"{step.method} {step.path} failed: {type(exc).__name__}: {exc}"
                load_tried |= step.loads
                rec["steps"].append({"step": step.what, "status": status, "seconds": round(time.time() - t, 4),
                                     **({"error": why} if why else {})})
                if why is not None and error is None:
                    error = why
            rec["t_loaded"] = time.time()
            if error is None:
                try:
                    now = await self.read_version()
                    if now != version:
                        error = f"the server reports weight_version {now!r} after the sync, not {version!r}"
                except Exception as exc:  # noqa: BLE001
                    error = f"the version could not be read back after the sync: {exc}"
            if error is None:
                after = version
                self.good_path = path
            else:
                after = await self._after_failure(before, version, load_tried)
        except BaseException as exc:  # (a bug, or cancellation) the held calls must still be released
            error = error or f"{type(exc).__name__}: {exc}"
            after = unknown(f"sync to {version} interrupted")
            raise
        finally:
            self.gate.release(after, error is None)
            self._name_unnamed()
            self._signal()
            t1 = time.time()
            rec.update(outcome="ok" if error is None else "failed", weight_version=after, t_released=t1,
                       recovery=self._recovery,
                       seconds=round(t1 - t0, 4), held_calls=self.gate.waiting, spanned_calls=len(spanned))
            if error is not None:
                rec["error"] = error
            self._record(rec)
        secs = {"total": rec["seconds"], "drain": round(rec["t_drained"] - t0, 4),
                "load": round(rec["t_loaded"] - rec["t_drained"], 4)}
        answer = {"weight_version": after, "previous_version": before, "server_kind": self.kind, "seconds": secs,
                  "held_calls": rec["held_calls"], "spanned_calls": len(spanned), "drained": rec["drained"]}
        if error is not None:
            log.error("polar: weight sync of %s to %r failed: %s (serving %r)", self.base, version, error, after)
            return 502, {"error": f"weight sync to {version!r} failed: {error}", **answer,
                         **({"recovery": self._recovery} if self._recovery else {})}
        log.info("polar: weight sync of %s: %r -> %r in %.3f s (%d calls held, %d spanned)", self.base, before,
                 version, rec["seconds"], rec["held_calls"], len(spanned))
        return 200, answer

    # -- a hold for another proxy's sync (several proxies in front of one server) -----------------
    async def hold_for_peer(self, version: str, drain_s: float, lease_s: float) -> tuple[int, dict]:
        """Hold new calls and drain for a sync another proxy runs; the gate then counts as loading
        (the calls still in flight span: the load may start any moment). Released by
        ``release_peer``, else after ``lease_s`` by itself."""
        try:
            self.gate.hold(version)
        except GateBusy as exc:
            return 409, {"error": str(exc)}
        t0 = time.time()
        self._signal()
        peer = self._peer = {"target": version, "previous_version": self.gate.version, "t_request": t0}
        try:
            drained = await self._until(lambda: self.gate.drained, drain_s)
        finally:
            # (also when cancelled: the gate must not stay held with nobody to release it)
            peer.update(drained=self.gate.drained, t_drained=time.time(), spanned=len(self.gate.load()))
            loop = asyncio.get_running_loop()
            peer["lease"] = loop.call_later(lease_s, lambda: asyncio.ensure_future(self._lease_expired(peer)))
        return 200, {"held": True, "target_version": version, "weight_version": self.gate.version,
                     "drained": drained, "in_flight": len(self.gate.inflight), "held_calls": self.gate.waiting,
                     "spanned_calls": peer["spanned"], "server_kind": self.kind}

    def release_peer(self, version: str, after: str | None, ok: bool, why: str = "") -> tuple[int, dict]:
        """End a hold_for_peer: new calls run under ``after`` (the version the sync answered)."""
        peer = self._peer
        if peer is None or peer["target"] != version or self.gate.state == SERVING:
            held = peer["target"] if peer else None
            return 409, {"error": f"no weight hold for version {version!r} to release (held for: {held!r}, "
                                  f"state {self.gate.state})"}
        self._peer = None
        peer["lease"].cancel()
        self.gate.release(after, ok)
        self._name_unnamed()
        self._signal()
        t1 = time.time()
        rec = {"upstream": self.base, "server_kind": self.kind, "role": "held for a peer's sync",
               "previous_version": peer["previous_version"], "target_version": version, "t_request": peer["t_request"],
               "drained": peer["drained"], "t_drained": peer["t_drained"], "t_released": t1,
               "outcome": "ok" if ok else "failed", "weight_version": after, "seconds": round(t1 - peer["t_request"], 4),
               "held_calls": self.gate.waiting, "spanned_calls": peer["spanned"], **({"error": why} if why else {})}
        self._record(rec)
        log.info("polar: weight hold of %s for %r released: serving %r (%s)", self.base, version, after, rec["outcome"])
        return 200, {"weight_version": after, "previous_version": peer["previous_version"], "released": True,
                     "held_calls": rec["held_calls"], "spanned_calls": peer["spanned"], "seconds": rec["seconds"]}

    async def _lease_expired(self, peer: dict) -> None:
        if self._peer is not peer:
            return
        try:
            after = await self.read_version() if self.kind in KINDS else self.gate.version
        except Exception as exc:  # noqa: BLE001
            after = unknown(f"version unreadable when a weight hold for {peer['target']} expired: {exc}"[:200])
        why = "the hold's lease expired with no release (the sync's coordinator is gone)"
        log.error("polar: weight hold of %s for %r: %s; serving %r as the server reports", self.base, peer["target"],
                  why, after)
        self.release_peer(peer["target"], after, after == peer["target"], why)

    async def _after_failure(self, before: str | None, target: str, load_tried: bool) -> str:
        """The version after a failed sync: the server's own word when its load is atomic. vLLM's
        in-place reload is not: a failed one leaves the model's weights unloaded (on the CPU build
        the next forward pass kills the engine: "onednn_mm ... Meta tensors"), so the proxy loads
        the previous weights again (``good_path``) and names them ``before``; when it cannot, an
        ``unknown:`` marker (polar_contracts/weight_versions.py) and an error log say the server may be
        unusable."""
        if load_tried and not ATOMIC[self.kind]:
            self._recovery = {"path": self.good_path}
            if self.good_path is not None and before is not None:
                why = None
                for step in sync_steps(self.kind, self.good_path, before, drained=True):
                    if why is not None and not step.always:
                        continue
                    try:
                        status, body = await self.http(step.method, self.base + step.path, step.body,
                                                       self.headers, self.timeout)
                        w = check_step(self.kind, step, status, body)
                    except Exception as exc:  # noqa: BLE001
                        w = f"{step.method} {step.path} failed: {exc}"
                    why = why or w
                self._recovery["outcome"] = "ok" if why is None else why
                if why is None:
                    log.warning("polar: %s: the failed sync to %r was undone: weights of %s loaded again as %r",
                                self.base, target, self.good_path, before)
                    return before
            log.error("polar: %s: a failed sync to %r may have left the weights unloaded or mixed and they "
                      "could not be loaded again (%s); the server may not serve until a good sync",
                      self.base, target, self._recovery)
            return unknown(f"a failed sync to {target} may have changed part of the weights")
        try:
            return await self.read_version()
        except Exception as exc:  # noqa: BLE001
            return unknown(f"version unreadable after a failed sync to {target}: {exc}"[:200])

    def _record(self, rec: dict) -> None:
        if not self.logdir:
            return
        line = json.dumps(rec, default=str) + "\n"
        if self.scrub is not None:  # a server's error may quote a credential back
            line = self.scrub()(line)
        try:
            append_line(os.path.join(self.logdir, SYNC_LOG), line)
        except (OSError, LogError) as exc:
            log.error("polar: could not append to %s: %s", SYNC_LOG, exc)

    def info(self) -> dict:
        g = self.gate
        return {"upstream": self.base, "server_kind": self.kind, "weight_version": g.version, "state": g.state,
                "target_version": g.target, "held_for_peer": self._peer is not None, "in_flight": len(g.inflight),
                "held_calls": g.waiting, "syncs": g.syncs}
