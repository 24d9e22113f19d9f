"""Every change the capture addon makes to mitmproxy itself or to its process, in one module.

Target: **mitmproxy 11.0.x** (setup.cfg pins 11.0.2). Each patch below touches internals that are
not mitmproxy's public addon API. Before it changes anything, a patch checks that this is the
mitmproxy it was written for and that every attribute it touches is there; if not, it logs a
warning (logger ``polar``) saying which patch, what is missing or which version was found, and
leaves mitmproxy as it is. The proxy then runs as stock mitmproxy would: never a silent skip,
never a crash. Each patch has an option that turns it off (the benchmark's "stock" path).

- **fast dispatch** (option ``polar_fast_dispatch``, default true). Touches
  ``AddonManager.trigger_event`` and ``AddonManager.trigger`` (replaced on the manager instance),
  ``AddonManager.chain`` (read at every event), ``mitmproxy.addonmanager.safecall`` (its error
  lines). Changes how events reach addons: the same calls in the same order, without mitmproxy's
  per-addon generator overhead. Other version or missing attribute: warning, mitmproxy's dispatch.
- **listen backlog** (option ``polar_listen_backlog``, default 1024). Touches the ``proxyserver``
  addon's ``servers``, each server instance's private ``_servers`` (its list of
  ``asyncio.Server``), their ``sockets``. Changes the accept-queue length of the listening sockets
  (``listen(backlog)`` again; mitmproxy's is 100). Other version or missing attribute: warning,
  mitmproxy's backlog.
- **gc freeze** (option ``polar_gc_freeze``, default true). Touches nothing of mitmproxy's: the
  process's garbage collector, ``gc.collect(); gc.freeze()`` once the proxy runs. Needs no
  version check.
- **quiet shutdown** (always on). Touches the process's ``asyncio`` logger, not mitmproxy: a
  logging filter that drops exactly one report, CPython 3.11's "Exception in callback" with a
  ``CancelledError`` raised by ``asyncio/streams.py``'s ``client_connected_cb`` done-callback
  (``task.exception()`` on a task cancelled when a connection is cut at exit; fixed in 3.12).
  A SIGTERM during a stream printed one such traceback per open connection; every other report
  is logged as before.

Measured in bench/bench_proxy.py (docs/benchmarks/proxy.md).

**Fast dispatch.** mitmproxy delivers every event by walking all ~35 addons of a mitmdump: for
each one a generator-based ``safecall()`` context manager, an ``invoke_addon`` coroutine and two
nested generators (``_iter_hooks``, ``traverse``), even for the ~30 addons that have no method
for the event. Each flow goes through four lifecycle events (requestheaders, request,
responseheaders, response), and after each one an ``update`` event to all addons again: ~0.2 ms
of pure dispatch per event here, ~0.6 ms a call, more than the capture addon's own work.
``install_fast_dispatch`` replaces ``trigger_event`` and ``trigger`` on one AddonManager
*instance* with plain loops that do the same thing:

- addons in chain order, each followed by its children depth first (mitmproxy's script loader,
  its scripts, their ``addons`` lists), each one's method looked up at every event (nothing is
  cached, so addons added, removed or reloaded take effect as before);
- an exception in one addon is logged through mitmproxy's ``safecall`` and the next top-level
  addon runs (the rest of the failing one's tree is skipped, as in mitmproxy);
  ``AddonHalt`` stops the event, ``OptionsError`` propagates;
- awaitables returned by a hook are awaited (``trigger_event``); a coroutine function reached by
  the synchronous ``trigger`` is an error, as in mitmproxy.

tests/addon/test_mitmproxy_patches.py runs both dispatchers over the same addon chains and
compares every call, error and log line. It reproduces 11.0.x's dispatch only: on another
version the patch is skipped (warning). ``uninstall_fast_dispatch`` gives mitmproxy's methods
back (option ``polar_fast_dispatch=false``).

**Listen backlog.** mitmproxy listens through ``asyncio.start_server``, whose backlog is 100. A
rollout node opening 256 connections at once overflows it while the event loop is busy; the
kernel then drops the handshake's last ACK and the harness's first bytes get a reset
("connection reset by peer"). Calling ``listen()`` again on a listening socket only changes its
backlog (Linux, BSD, macOS), so the proxy keeps its sockets and mitmproxy its servers. The
sockets are reached through ``ServerInstance._servers`` (private); without it the patch is
skipped with a warning.

**gc freeze.** Every full collection of the cyclic garbage collector walks every object alive,
~100k of them after mitmproxy's start-up (its addons, option tables, certificate store), while
the objects a call creates (parsed JSON, id lists) are acyclic and freed by reference counting
anyway. ``gc.freeze()`` once the proxy runs moves the start-up objects out of the collector's
sight, so collections cost what the calls in flight cost. Nothing is leaked: frozen objects are
the ones that live for the whole process. It touches no mitmproxy internals and needs no version
check; it is here because it is the addon's only other process-level change.
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


def _not_callable(name: str, addon) -> exceptions.AddonManagerError:
    return exceptions.AddonManagerError(f"Addon handler {name} ({addon}) not callable")


def _log_addon_error() -> None:
    """mitmproxy's error line for a failing addon (its ``safecall``), for the exception being
    handled; the event goes on with the next top-level addon. (The two dispatch loops below are
    the async and sync versions of one loop: Python cannot share a body across the two.)"""
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
                    if func:
                        if callable(func):
                            res = func(*args)
                            if res is not None and inspect.isawaitable(res):
                                await res
                        elif not isinstance(func, types.ModuleType):  # (a module named like a hook is skipped)
                            raise _not_callable(name, a)
                    a, stack = _next(a, stack)
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception:
                _log_addon_error()

    def trigger(event) -> None:
        name = event.name
        args = event.args()
        for top in manager.chain:
            try:
                a, stack = top, None
                while a is not _DONE:
                    func = getattr(a, name, None)
                    if func:
                        if callable(func):
                            if inspect.iscoroutinefunction(func):
                                raise exceptions.AddonManagerError(
                                    f"Async handler {name} ({a}) cannot be called from sync context")
                            func(*args)
                        elif not isinstance(func, types.ModuleType):
                            raise _not_callable(name, a)
                    a, stack = _next(a, stack)
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception:
                _log_addon_error()

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


class Tuning:
    """Options ``polar_listen_backlog`` and ``polar_gc_freeze``, applied once the proxy runs."""

    def load(self, loader) -> None:
        quiet_shutdown()
        loader.add_option("polar_listen_backlog", int, 1024,
                          "Accept-queue length of the proxy's listening sockets (mitmproxy's is 100, which "
                          "256 harness connections opened at once overflow; the kernel caps it at "
                          "net.core.somaxconn). 0 leaves mitmproxy's.")
        loader.add_option("polar_gc_freeze", bool, True,
                          "gc.freeze() once the proxy runs: the cyclic collector stops re-walking the "
                          "~100k objects of mitmproxy's start-up on every full collection.")

    def configure(self, updated) -> None:
        if "polar_listen_backlog" in updated and ctx.options.polar_listen_backlog < 0:
            raise exceptions.OptionsError(
                f"polar_listen_backlog must be >= 0, not {ctx.options.polar_listen_backlog}")

    def running(self) -> None:
        if ctx.options.polar_listen_backlog:
            raise_listen_backlog(ctx.master.addons.get("proxyserver"), ctx.options.polar_listen_backlog)
        if ctx.options.polar_gc_freeze:
            freeze_startup_objects()
