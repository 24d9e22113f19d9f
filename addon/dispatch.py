"""mitmproxy's event dispatch, the same calls in the same order, without its per-addon overhead.

mitmproxy delivers every event by walking all ~35 addons of a mitmdump: for each one a
generator-based ``safecall()`` context manager, an ``invoke_addon`` coroutine and two nested
generators (``_iter_hooks``, ``traverse``), even for the ~30 addons that have no method for the
event. Each flow goes through four lifecycle events (requestheaders, request, responseheaders,
response), and after each one an ``update`` event to all addons again: ~0.2 ms of pure dispatch per
event here, ~0.6 ms a call, more than the capture addon's own work. bench/bench_proxy.py.

``install`` replaces ``trigger_event`` and ``trigger`` on one AddonManager *instance* with plain loops
that do the same thing:
- addons in chain order, each followed by its children depth first (mitmproxy's script loader,
  its scripts, their ``addons`` lists), each one's method looked up at every event (nothing is
  cached, so addons added, removed or reloaded take effect as before);
- an exception in one addon is logged through mitmproxy's ``safecall`` and the next top-level
  addon runs (the rest of the failing one's tree is skipped, as in mitmproxy);
  ``AddonHalt`` stops the event, ``OptionsError`` propagates;
- awaitables returned by a hook are awaited (``trigger_event``); a coroutine function reached by
  the synchronous ``trigger`` is an error, as in mitmproxy.
tests/addon/test_dispatch.py runs both dispatchers over the same addon chains and compares every
call, error and log line. It installs only on mitmproxy 11.0.x, whose dispatch it reproduces.
``uninstall`` gives mitmproxy's methods back (option ``polar_fast_dispatch=false``).
"""
from __future__ import annotations

import inspect
import logging
import types

from mitmproxy import ctx, exceptions
from mitmproxy import version as mitmproxy_version
from mitmproxy.addonmanager import safecall

log = logging.getLogger("polar")
_MARK = "_polar_fast_dispatch"
# The mitmproxy whose dispatch these loops reproduce (setup.cfg pins it); another version may
# dispatch differently, so it keeps its own.
KNOWN_VERSION = "11.0."


def _not_callable(name: str, addon) -> exceptions.AddonManagerError:
    return exceptions.AddonManagerError(f"Addon handler {name} ({addon}) not callable")


def _log_addon_error() -> None:
    """mitmproxy's error line for a failing addon (its ``safecall``), for the exception being
    handled; the event goes on with the next top-level addon. (The two dispatch loops below are
    the async and sync versions of one loop: Python cannot share a body across the two.)"""
    with safecall():
        raise


_DONE = object()


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


def install(manager, mitmproxy_at: str = mitmproxy_version.VERSION) -> bool:
    """Use the fast dispatch on this AddonManager; False (nothing changed) unless this is the
    mitmproxy it reproduces."""
    if getattr(manager, _MARK, False):
        return True
    if not mitmproxy_at.startswith(KNOWN_VERSION) or \
            not all(hasattr(manager, a) for a in ("chain", "trigger_event", "trigger")):
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


def uninstall(manager) -> None:
    if getattr(manager, _MARK, False):
        for a in ("trigger_event", "trigger", _MARK):
            manager.__dict__.pop(a, None)


class FastDispatch:
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
            uninstall(manager)
        elif install(manager):
            log.info("polar: fast addon dispatch on")
        else:
            log.warning("polar: polar_fast_dispatch reproduces mitmproxy %sx's dispatch, this is %s; "
                        "using mitmproxy's own", KNOWN_VERSION, mitmproxy_version.VERSION)
