"""Every change the capture addon makes to mitmproxy itself or to its process, in one module.

Target: mitmproxy 11.0.x (setup.cfg pins 11.0.2). Each patch that touches mitmproxy internals
first checks the version and every attribute it touches; if either is off it logs a warning
(logger ``polar``) naming the patch and what is missing, and leaves mitmproxy as it is: never a
silent skip, never a crash. Options turn the first three off (the benchmark's "stock" path):

- fast dispatch (``polar_fast_dispatch``): ``AddonManager.trigger_event`` / ``trigger`` replaced
  on the manager instance by plain loops making the same calls in the same order;
- listen backlog (``polar_listen_backlog``): ``listen(backlog)`` again on mitmproxy's listening
  sockets (its own is 100);
- gc freeze (``polar_gc_freeze``): ``gc.collect(); gc.freeze()`` once the proxy runs;
- quiet shutdown (always on): a filter on the ``asyncio`` logger for CPython 3.11's one spurious
  CancelledError report per connection cut at exit;
- lazy upstream connections (``polar_lazy_connect``): mitmproxy's own ``connection_strategy``
  option set to ``lazy`` (public API, no internals), so the proxy reads a request before it
  connects upstream and its own endpoints answer while the server is down or restarting.

What each touches, why, and how it is tested: docs/capture.md, "Changes to mitmproxy itself".
Measured in bench/bench_proxy.py (docs/benchmarks/proxy.md).
"""
from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import socket
import types

from mitmproxy import ctx, exceptions
from mitmproxy import version as mitmproxy_version
from mitmproxy.addonmanager import safecall

log = logging.getLogger("polar")

# The mitmproxy whose internals these patches were written against (setup.cfg pins it).
TARGET_VERSION = "11.0."


def targets(patch: str, found: str | None = None) -> bool:
    """Whether ``found`` (default: the running mitmproxy) is the version the patches target;
    if not, a warning that ``patch`` is skipped."""
    found = mitmproxy_version.VERSION if found is None else found
    if found.startswith(TARGET_VERSION):
        return True
    log.warning("polar: %s skipped: it patches mitmproxy %sx internals, this is mitmproxy %s; "
                "mitmproxy's own behaviour is kept", patch, TARGET_VERSION, found)
    return False


def has_attrs(patch: str, obj, attrs: tuple[str, ...], what: str) -> bool:
    """Whether ``obj`` has every one of ``attrs``; if not, a warning naming the missing ones and
    that ``patch`` is skipped."""
    missing = [a for a in attrs if not hasattr(obj, a)]
    if not missing:
        return True
    log.warning("polar: %s skipped: %s has no %s (mitmproxy %s; the patch targets %sx); "
                "mitmproxy's own behaviour is kept", patch, what, ", ".join(missing),
                mitmproxy_version.VERSION, TARGET_VERSION)
    return False


# ---------------------------------------------------------------------------------------------
# fast dispatch: AddonManager.trigger_event / trigger

FAST_DISPATCH = "fast dispatch patch (polar_fast_dispatch)"
_MARK = "_polar_fast_dispatch"
_DONE = object()


def _hook(attr: object, name: str, addon: object) -> bool:
    """An addon attribute named like the event that is not callable (the loops call ``callable``
    first, inline): a module is skipped (False), anything else is an error, as in mitmproxy."""
    if isinstance(attr, types.ModuleType):
        return False
    raise exceptions.AddonManagerError(f"Addon handler {name} ({addon}) not callable")


def _stops_event(exc: Exception) -> bool:
    """What both dispatch loops do with an exception out of an addon's tree, as mitmproxy does:
    ``AddonHalt`` stops the event (True), ``OptionsError`` propagates, anything else gets
    mitmproxy's error line (its ``safecall``) and the event goes on with the next top-level addon
    (False). Called in the ``except`` block (``raise`` re-raises the exception being handled).
    (The two loops are the async and sync versions of one loop: Python cannot share a body across
    the two, so they share this and ``_hook``.)"""
    if isinstance(exc, exceptions.AddonHalt):
        return True
    if isinstance(exc, exceptions.OptionsError):
        raise  # (the exception being handled, with its traceback)
    with safecall():
        raise


def _next(a, stack: list | None):
    """The addon after ``a`` in a depth-first walk of its top-level addon's tree (mitmproxy's
    ``traverse``: children are read after the addon's own hook ran, lists as they are then);
    ``(_DONE, None)`` at the end. ``stack`` holds the iterators of the lists being walked."""
    if hasattr(a, "addons"):
        it = iter(a.addons)
        if stack is None:
            stack = [it]
        else:
            stack.append(it)
    while stack:
        nxt = next(stack[-1], _DONE)
        if nxt is not _DONE:
            return nxt, stack
        stack.pop()
    return _DONE, None


def install_fast_dispatch(manager, mitmproxy_at: str | None = None) -> bool:
    """Use the fast dispatch on this AddonManager. False, with a warning and nothing changed,
    unless this is the mitmproxy it reproduces and the manager has the attributes it replaces."""
    if getattr(manager, _MARK, False):
        return True
    if not targets(FAST_DISPATCH, mitmproxy_at) or \
            not has_attrs(FAST_DISPATCH, manager, ("chain", "trigger_event", "trigger"), "the AddonManager"):
        return False

    async def trigger_event(event) -> None:
        name = event.name
        args = event.args()
        for top in manager.chain:
            try:
                a, stack = top, None
                while a is not _DONE:  # top, then its tree depth first, as mitmproxy's traverse()
                    func = getattr(a, name, None)
                    if func and (callable(func) or _hook(func, name, a)):
                        res = func(*args)
                        if res is not None and inspect.isawaitable(res):
                            await res
                    a, stack = _next(a, stack)
            except Exception as exc:
                if _stops_event(exc):
                    return

    def trigger(event) -> None:
        name = event.name
        args = event.args()
        for top in manager.chain:
            try:
                a, stack = top, None
                while a is not _DONE:
                    func = getattr(a, name, None)
                    if func and (callable(func) or _hook(func, name, a)):
                        if inspect.iscoroutinefunction(func):
                            raise exceptions.AddonManagerError(
                                f"Async handler {name} ({a}) cannot be called from sync context")
                        func(*args)
                    a, stack = _next(a, stack)
            except Exception as exc:
                if _stops_event(exc):
                    return

    manager.trigger_event = trigger_event
    manager.trigger = trigger
    setattr(manager, _MARK, True)
    return True


def uninstall_fast_dispatch(manager) -> None:
    if getattr(manager, _MARK, False):
        for a in ("trigger_event", "trigger", _MARK):
            manager.__dict__.pop(a, None)


class FastDispatch:
    """Option ``polar_fast_dispatch``: the fast dispatch on mitmproxy's AddonManager."""

    def load(self, loader) -> None:
        loader.add_option("polar_fast_dispatch", bool, True,
                          "Deliver mitmproxy's events to its addons without its per-addon generator and "
                          "context-manager overhead (same calls, same order, same error handling; "
                          "~0.6 ms less proxy CPU a call). false: mitmproxy's own dispatch.")

    def configure(self, updated) -> None:
        if "polar_fast_dispatch" not in updated:
            return
        manager = ctx.master.addons
        if not ctx.options.polar_fast_dispatch:
            uninstall_fast_dispatch(manager)
        elif install_fast_dispatch(manager):
            log.info("polar: fast addon dispatch on")


# ---------------------------------------------------------------------------------------------
# listen backlog: the proxyserver addon's ServerInstance._servers

LISTEN_BACKLOG = "listen backlog patch (polar_listen_backlog)"


def listening_sockets(proxyserver) -> list | None:
    """The TCP sockets mitmproxy's proxy servers listen on (asyncio TransportSocket objects);
    None, with a warning, when mitmproxy's internals are not where this patch expects them."""
    if proxyserver is None:
        log.warning("polar: %s skipped: mitmproxy has no proxyserver addon", LISTEN_BACKLOG)
        return None
    if not has_attrs(LISTEN_BACKLOG, proxyserver, ("servers",), "the proxyserver addon"):
        return None
    out = []
    for instance in proxyserver.servers:
        if not has_attrs(LISTEN_BACKLOG, instance, ("_servers",), f"server instance {type(instance).__name__}"):
            return None
        for server in instance._servers:
            out.extend(getattr(server, "sockets", None) or ())  # (UDP servers have none)
    return out


def set_backlog(sock, backlog: int) -> bool:
    """Raise the accept-queue length of a listening socket in place (a dup shares the socket)."""
    try:
        dup = socket.socket(sock.family, sock.type, sock.proto, fileno=socket.dup(sock.fileno()))
    except OSError:
        return False
    try:
        dup.listen(backlog)
        return True
    except OSError:
        return False
    finally:
        dup.close()  # closing the dup leaves the original listening


def raise_listen_backlog(proxyserver, backlog: int, mitmproxy_at: str | None = None) -> list:
    """``listen(backlog)`` on every socket mitmproxy's proxy servers listen on; the sockets
    raised (empty, with a warning, when the patch had to be skipped)."""
    if not targets(LISTEN_BACKLOG, mitmproxy_at):
        return []
    socks = listening_sockets(proxyserver)
    if socks is None:
        return []
    raised = [s for s in socks if set_backlog(s, backlog)]
    if raised:
        log.info("polar: listen backlog %d on %s", backlog,
                 ", ".join(f"{a[0]}:{a[1]}" for a in (s.getsockname() for s in raised)))
    if len(raised) < len(socks):
        log.warning("polar: could not raise the listen backlog of %d of %d sockets",
                    len(socks) - len(raised), len(socks))
    return raised


# ---------------------------------------------------------------------------------------------
# gc freeze: the process's collector


class StreamsCancelNoise(logging.Filter):
    """Drops the one asyncio report quiet shutdown is about (module doc): the loop's "Exception in
    callback" for a CancelledError out of asyncio/streams.py's client_connected_cb done-callback.
    A logging filter, not a loop exception handler: mitmproxy's run() swaps handlers in and out, and
    the connections are cut after it returns."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, asyncio.CancelledError) and "StreamReaderProtocol.connection_made" in
                    str(record.msg) and "callback" in str(record.msg))


def quiet_shutdown() -> None:
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, StreamsCancelNoise) for f in logger.filters):
        logger.addFilter(StreamsCancelNoise())


def freeze_startup_objects() -> None:
    gc.collect()
    gc.freeze()


def lazy_connect(options) -> bool:
    """mitmproxy's ``connection_strategy`` set to ``lazy``: True when it changed. With ``eager``
    (mitmproxy's default) a reverse proxy connects upstream as soon as a client connects and, when
    that fails, closes the client's connection before reading any request: the proxy's own control
    endpoints (``/polar/@control``, ``/polar/<id>/end``), which are never forwarded, got an empty
    reply whenever the inference server was down or restarting."""
    if options.connection_strategy == "lazy":
        return False
    options.update(connection_strategy="lazy")
    return True


class Tuning:
    """Options ``polar_listen_backlog``, ``polar_gc_freeze`` (applied once the proxy runs) and
    ``polar_lazy_connect`` (applied at once)."""

    def load(self, loader) -> None:
        quiet_shutdown()
        loader.add_option("polar_listen_backlog", int, 1024,
                          "Accept-queue length of the proxy's listening sockets (mitmproxy's is 100, which "
                          "256 harness connections opened at once overflow; the kernel caps it at "
                          "net.core.somaxconn). 0 leaves mitmproxy's.")
        loader.add_option("polar_gc_freeze", bool, True,
                          "gc.freeze() once the proxy runs: the cyclic collector stops re-walking the "
                          "~100k objects of mitmproxy's start-up on every full collection.")
        loader.add_option("polar_lazy_connect", bool, True,
                          "Set mitmproxy's connection_strategy to lazy: connect upstream only when a request is "
                          "forwarded, so the proxy's own endpoints (/polar/@control, /polar/<id>/end) answer while "
                          "the inference server is down, slow or restarting (with eager, mitmproxy's default, a "
                          "client of a reverse proxy whose server is down gets its connection closed before any "
                          "request is read). false: connection_strategy is left as set.")

    def configure(self, updated) -> None:
        # (also when connection_strategy itself changes: this option decides while it is true)
        if updated & {"polar_lazy_connect", "connection_strategy"} and ctx.options.polar_lazy_connect:
            if lazy_connect(ctx.options):
                log.info("polar: connection_strategy=lazy (polar_lazy_connect)")
        if "polar_listen_backlog" in updated and ctx.options.polar_listen_backlog < 0:
            raise exceptions.OptionsError(
                f"polar_listen_backlog must be >= 0, not {ctx.options.polar_listen_backlog}")

    def running(self) -> None:
        if ctx.options.polar_listen_backlog:
            raise_listen_backlog(ctx.master.addons.get("proxyserver"), ctx.options.polar_listen_backlog)
        if ctx.options.polar_gc_freeze:
            freeze_startup_objects()
