"""What the proxy knows of each upstream server it forwards model calls to: the server's identity.

Three facts the rows need and no answer carries, each learned from the server itself before the
first call to it is recorded, and kept per upstream base URL:

- its dialect (vLLM or SGLang: which flags return token ids; server_dialects.py), read from
  ``GET /v1/models`` ``owned_by`` (option ``polar_dialect``, default ``auto``);
- the sampling defaults it applies to fields a request leaves unset (applied_sampling.py), from
  ``polar_generation_config``, else asked of the server (sampling_discovery.py);
- what its logprobs are (the rows' ``logprobs_mode``: logprobs_probe.py), probed (option
  ``polar_logprobs_mode``, default ``auto``).

``Upstreams`` holds all three for every upstream. ``forget(base)`` drops everything known of one
upstream (or of all), so that the next call to it learns its identity again: a server restarted
with other flags is another server. A probe or discovery still in flight when it is forgotten
does not write its answer back (it answers only the calls already waiting for it).

A server restarted between calls (say with another ``--logprobs-mode``) fails no call, so the
proxy cannot see the restart itself; it sees that it opens a new connection to the server (every
connection to the old server closed with it). ``connecting(address)`` is told so, and forgets
what was learned of that server more than ``recheck_s`` (option ``polar_identity_recheck_s``)
ago: the call that opens the connection waits for the identity to be learned again, as the first
call did, so its rows carry the restarted server's mode. The re-learning costs two tiny
completions (the probe) and a model listing, at most once per ``recheck_s`` per server.

The I/O (urllib on worker threads) is in the modules named above; this one schedules it and
caches the answers. The option values are set by model_calls.ModelCalls.configure.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request

from addon.applied_sampling import ModelDefaults
from addon.logprobs_probe import PROBE_TIMEOUT, ModeCache, probe_upstream
from addon.sampling_discovery import FIX as DISCOVERY_FIX
from addon.sampling_discovery import RETRY_S as DISCOVERY_RETRY_S
from addon.sampling_discovery import Discovery, discover
from addon.server_dialects import dialect_from_models

log = logging.getLogger("polar")

LOGPROBS_MODES = ("auto", "processed", "raw", "scaled", "unknown")  # option polar_logprobs_mode
RECHECK_S = 10  # default of option polar_identity_recheck_s (an int: mitmdump --set parses no floats)


def probe_dialect(base_url: str, timeout: float = 5.0) -> str | None:
    """GET /v1/models on the upstream and read owned_by (see server_dialects.py)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=timeout) as r:
            return dialect_from_models(json.loads(r.read()))
    except Exception as exc:  # noqa: BLE001 - any failure means "unknown"
        log.warning("polar: dialect probe of %s failed: %s", base_url, exc)
        return None


class Upstreams:
    """The identity of every upstream (module docstring), learned once per upstream and shared by
    the calls that arrive while it is being learned. One per proxy (proxy_state.ProxyState)."""

    def __init__(self) -> None:
        # the options (model_calls.ModelCalls.configure sets them)
        self.dialect_option = "auto"  # polar_dialect: vllm | sglang | auto
        self.sampling_option: ModelDefaults | None = None  # polar_generation_config (None: unset)
        self.logprobs_mode_option = "auto"  # polar_logprobs_mode
        self.probe_timeout_s = PROBE_TIMEOUT  # polar_probe_timeout_s
        self.recheck_s = RECHECK_S  # polar_identity_recheck_s (negative: never)
        # host:port -> when its identity was last taken as current (its first connection, or a recheck)
        self._current_since: dict[str, float] = {}
        # what was learned, per upstream (dialects are keyed by scheme://host:port, the rest by
        # the base URL with its path prefix, as the requests that learn them are sent)
        self._dialects: dict[str, str] = {}
        # sampling discovery: each upstream's answer, with the time after which an indefinite one
        # (the server could not be asked) is asked again; and the discoveries in flight, shared
        # by the calls that wait for them
        self._discovered: dict[str, tuple[Discovery, float]] = {}
        self._discovering: dict[str, asyncio.Future[Discovery]] = {}
        self.logprobs_modes = ModeCache()  # each upstream's logprobs mode and its probe in flight
        self._warned_unknown_sampling = False

    # -- forgetting -------------------------------------------------------------------------------
    def forget(self, base: str | None = None) -> None:
        """Forget what is known of upstream ``base`` (every upstream: None): its next call learns
        its dialect, sampling defaults and logprobs mode again (a server restarted as another)."""
        for cache in (self._dialects, self._discovered, self._discovering):
            for key in [k for k in cache if base is None or k == base or k == _host_of(base)]:
                del cache[key]
        self.forget_logprobs_mode(base)

    def forget_logprobs_mode(self, base: str | None = None) -> None:
        """Forget the logprobs mode of upstream ``base`` (all: None); its next call probes again.
        After a weight sync and when a call to the upstream fails to connect."""
        self.logprobs_modes.invalidate(base)

    def connecting(self, address: str, now: float) -> bool:
        """The proxy opens a new connection to the server at ``address`` (host:port): forget its
        identity when it was learned more than recheck_s ago (module docstring). True if forgotten."""
        since = self._current_since.get(address)
        if since is None or self.recheck_s < 0 or now - since < self.recheck_s:
            self._current_since.setdefault(address, now)
            return False
        self._current_since[address] = now
        known = [k for k in (*self._dialects, *self._discovered, *self._discovering, *self.logprobs_modes.bases())
                 if _address_of(k) == address]
        for key in set(known):
            self.forget(key)
        if known:
            log.info("polar: a new connection to %s: its dialect, sampling defaults and logprobs mode are learned "
                     "again (a restarted server may be another; polar_identity_recheck_s)", address)
        return bool(known)

    # -- dialect ----------------------------------------------------------------------------------
    async def dialect(self, host_base: str) -> str:
        """The dialect of the server at ``host_base`` (scheme://host:port): the option's, else
        asked of the server once (vllm when it cannot tell, with a warning)."""
        if self.dialect_option != "auto":
            return self.dialect_option
        d = self._dialects.get(host_base)
        if d is None:
            found = await asyncio.to_thread(probe_dialect, host_base)
            d = found or "vllm"
            if found is None:
                log.warning("polar: could not tell the dialect of %s from /v1/models; using vllm", host_base)
            self._dialects[host_base] = d
        return d

    # -- sampling defaults ------------------------------------------------------------------------
    async def sampling_defaults(self, base: str, dialect: str,
                                headers: dict[str, str]) -> tuple[ModelDefaults | None, str]:
        """The served model's sampling defaults and, when unknown, why: the option's, else what the
        upstream says it serves (asked once per upstream; the calls that arrive meanwhile wait for
        the answer, so no row is recorded before it: the first rows must not differ from the rest).
        ``headers``: the discovery requests' (the server's Authorization)."""
        if self.sampling_option is not None:
            return self.sampling_option, ""
        found = self._discovered.get(base)
        if found is not None and (found[0].definite or time.monotonic() < found[1]):
            return found[0].defaults, found[0].why
        task = self._discovering.get(base)
        if task is None:
            task = self._discovering[base] = asyncio.ensure_future(
                asyncio.to_thread(discover, base, dialect, None, headers))
            task.add_done_callback(lambda t, b=base: self._discovered_now(b, t))
        d = await asyncio.shield(task)
        return d.defaults, d.why

    def _discovered_now(self, base: str, task: asyncio.Future[Discovery]) -> None:
        if self._discovering.get(base) is not task:
            return  # (forgotten meanwhile: the answer was the restarted server's predecessor's)
        del self._discovering[base]
        d = task.result() if not task.cancelled() and task.exception() is None else Discovery(
            None, f"sampling discovery failed ({task.exception() if not task.cancelled() else 'cancelled'}): "
                  f"{DISCOVERY_FIX}", definite=False)
        self._discovered[base] = (d, time.monotonic() + DISCOVERY_RETRY_S)
        if d.defaults is not None:
            log.info("polar: sampling defaults of %s: %s (%s)", base, d.defaults.values, d.defaults.origin)
        else:
            log.warning("polar: the sampling defaults of %s are unknown: %s. Rows record the fields a request "
                        "leaves unset as null, with this reason in sampling_source.", base, d.why)

    def warn_unknown_sampling(self, unset: tuple[str, ...], why: str) -> None:
        """Once per proxy: a request left ``unset`` fields the server's defaults for which are unknown."""
        if unset and not self._warned_unknown_sampling:
            self._warned_unknown_sampling = True
            log.warning("polar: a request leaves %s unset and the server's defaults for them are unknown (%s): rows "
                        "record them as null (unknown). Set --set polar_generation_config=<model dir> (or 'none').",
                        ", ".join(unset), why)

    # -- logprobs mode ----------------------------------------------------------------------------
    async def logprobs_mode(self, base: str, model: str | None, headers: dict[str, str]) -> str | None:
        """The upstream's logprobs mode: the option's, else probed once per upstream; the calls
        that arrive while the probe is in flight wait for it (bounded by probe_timeout_s per probe
        request). ``headers``: the probe's (the server's Authorization)."""
        opt = self.logprobs_mode_option
        if opt != "auto":
            return None if opt == "unknown" else opt
        cache = self.logprobs_modes
        if cache.should_probe(base, time.monotonic()):
            cache.started(base, asyncio.ensure_future(self._probe(base, model, headers)))
        task = cache.entry(base).task
        if task is not None:
            # Held until the probe answers (the server is then idle but for the probe, and a cold
            # server's first answers may take long): a row recorded before its mode is known would
            # carry null, and a run's first rows would disagree with its later ones.
            await asyncio.shield(task)
        return cache.mode(base)

    async def _probe(self, base: str, model: str | None, headers: dict[str, str]) -> None:
        generation = self.logprobs_modes.entry(base).generation
        mode = None
        try:
            mode = await asyncio.to_thread(probe_upstream, base, model, self.probe_timeout_s, headers)
            if mode is None:
                log.warning("polar: the logprobs-mode probe of %s could not tell processed, raw or scaled: rows "
                            "record logprobs_mode null until a later probe can (or set polar_logprobs_mode)", base)
        except Exception as exc:  # noqa: BLE001 - any failure means "unknown", retried later
            log.warning("polar: the logprobs-mode probe of %s failed (%s: %s): rows record logprobs_mode null "
                        "until a later probe succeeds", base, type(exc).__name__, exc)
        self.logprobs_modes.done(base, generation, mode, time.monotonic())


def _host_of(base: str | None) -> str | None:
    """scheme://host:port of a base URL (the dialect cache's key), dropping any path prefix."""
    if base is None:
        return None
    scheme, sep, rest = base.partition("://")
    return scheme + sep + rest.split("/", 1)[0]


def _address_of(base: str) -> str:
    """host:port of a base URL (scheme://host:port[/prefix])."""
    return base.partition("://")[2].split("/", 1)[0]
