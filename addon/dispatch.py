"""mitmproxy's event dispatch, the same calls in the same order, without its per-addon overhead.

mitmproxy delivers every event by walking all ~35 addons of a mitmdump: for each one a
generator-based ``safecall()`` context manager, an ``invoke_addon`` coroutine and two nested
generators (``_iter_hooks``, ``traverse``), even for the ~30 addons that have no method for the
event. Each flow goes through four lifecycle events (requestheaders, request, responseheaders,
response), and after each one an ``update`` event to all addons again: ~0.2 ms of pure dispatch per
event here, ~0.6 ms a call, more than the capture addon's own work. bench/bench_proxy.py.

``install`` replaces ``trigger_event`` and ``trigger`` on one AddonManager *instance* with loops that
do the same thing for addons without children, and hand addons with children (mitmproxy's script
loader, and so the scripts themselves) to mitmproxy's own ``invoke_addon``, unchanged:
- addons in chain order, each one's method looked up at every event (nothing is cached, so addons
  added, removed or reloaded take effect as before);
- an exception in one addon is logged through mitmproxy's ``safecall`` and the next addon runs;
  ``AddonHalt`` stops the event, ``OptionsError`` propagates;
- awaitables returned by a hook are awaited (``trigger_event``); a coroutine function reached by
  the synchronous ``trigger`` is an error, as in mitmproxy.
tests/addon/test_dispatch.py runs both dispatchers over the same addon chains and compares every
call, error and log line. ``uninstall`` gives mitmproxy's methods back (option
``polar_fast_dispatch=false``).
"""
from __future__ import annotations

import inspect
import logging
import types

from mitmproxy import ctx, exceptions
from mitmproxy.addonmanager import safecall

log = logging.getLogger("polar")
_MARK = "_polar_fast_dispatch"


def _not_callable(name: str, addon) -> exceptions.AddonManagerError:
    return exceptions.AddonManagerError(f"Addon handler {name} ({addon}) not callable")


def install(manager) -> bool:
    """Use the fast dispatch on this AddonManager; False if it does not look like mitmproxy 11's."""
    if getattr(manager, _MARK, False):
        return True
    if not all(hasattr(manager, a) for a in ("chain", "invoke_addon", "invoke_addon_sync", "trigger_event", "trigger")):
        return False

    async def trigger_event(event) -> None:
        name = event.name
        args = event.args()
        for top in manager.chain:
            try:
                if hasattr(top, "addons"):  # a tree: mitmproxy's own walk, unchanged
                    with safecall():
                        await manager.invoke_addon(top, event)
                    continue
                func = getattr(top, name, None)
                if not func:
                    continue
                if callable(func):
                    res = func(*args)
                    if res is not None and inspect.isawaitable(res):
                        await res
                elif not isinstance(func, types.ModuleType):  # (a module named like a hook is skipped)
                    raise _not_callable(name, top)
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception:
                with safecall():  # mitmproxy's error log line for a failing addon
                    raise

    def trigger(event) -> None:
        name = event.name
        args = event.args()
        for top in manager.chain:
            try:
                if hasattr(top, "addons"):
                    with safecall():
                        manager.invoke_addon_sync(top, event)
                    continue
                func = getattr(top, name, None)
                if not func:
                    continue
                if callable(func):
                    if inspect.iscoroutinefunction(func):
                        raise exceptions.AddonManagerError(
                            f"Async handler {name} ({top}) cannot be called from sync context")
                    func(*args)
                elif not isinstance(func, types.ModuleType):
                    raise _not_callable(name, top)
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception:
                with safecall():
                    raise

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
            log.warning("polar: this mitmproxy's AddonManager is not the one polar_fast_dispatch knows; "
                        "using mitmproxy's own dispatch")
