"""addon/dispatch.py: the fast dispatch makes exactly mitmproxy's calls, in mitmproxy's order,
with mitmproxy's error handling. Random addon chains run through a stock AddonManager and a
fast one side by side; every hook call, every awaited coroutine and every error log line must
match."""
from __future__ import annotations

import asyncio
import logging
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import exceptions, hooks, options
from mitmproxy.log import AddLogHook, LogEntry
from mitmproxy.master import Master
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
from mitmproxy.test import tflow

from addon import dispatch

# what an addon does when it gets an event
BEHAVIOURS = ("absent", "sync", "async", "returns_awaitable", "raises", "halts", "not_callable", "module")


class Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def make_addon(spec, calls: list):
    """spec: (name, {event: behaviour}, children specs, as_module). ``as_module``: a module whose
    hooks are module-level functions, as a script's namespace is under mitmproxy's script loader."""
    name, events, children, as_module = spec
    ns = {"__repr__": lambda self: f"<{name}>"}
    for event, how in events.items():
        if how == "absent":
            continue
        if how == "sync":
            ns[event] = (lambda ev: lambda self, *a: calls.append((name, ev, "sync")))(event)
        elif how == "async":
            async def f(self, *a, _ev=event):
                calls.append((name, _ev, "async-start"))
                await asyncio.sleep(0)
                calls.append((name, _ev, "async-end"))
            ns[event] = f
        elif how == "returns_awaitable":
            def f(self, *a, _ev=event):
                calls.append((name, _ev, "returns"))

                async def later():
                    calls.append((name, _ev, "awaited"))
                return later()
            ns[event] = f
        elif how == "raises":
            def f(self, *a, _ev=event):
                calls.append((name, _ev, "raises"))
                raise ValueError(f"{name} fails at {_ev}")
            ns[event] = f
        elif how == "halts":
            def f(self, *a, _ev=event):
                calls.append((name, _ev, "halts"))
                raise exceptions.AddonHalt()
            ns[event] = f
        elif how == "not_callable":
            ns[event] = 42
        elif how == "module":
            ns[event] = types.ModuleType(event)
    if as_module:
        addon = types.ModuleType(name)
        for k, v in ns.items():
            if k != "__repr__":
                setattr(addon, k, v.__get__(addon) if callable(v) else v)  # (bound: called as f(flow))
    else:
        addon = type(name, (), ns)()
    if children is not None:
        addon.addons = [make_addon(c, calls) for c in children]
    return addon


EVENTS = ("request", "response", "update", "add_log")


def specs(depth=0):
    behaviours = st.fixed_dictionaries({e: st.sampled_from(BEHAVIOURS) for e in EVENTS})
    children = st.none() if depth >= 2 else st.one_of(st.none(), st.lists(specs(depth + 1), max_size=3))
    return st.tuples(st.from_regex(r"[A-Z][a-z]{2,6}", fullmatch=True), behaviours, children, st.booleans())


def new_master() -> Master:
    m = Master(options.Options(), event_loop=asyncio.get_running_loop())
    # the master forwards every log record to the addons as add_log events, later, on its loop:
    # here that would feed the error lines of one run back into its own chain
    m._legacy_log_events.uninstall()
    return m


async def run_chain(chain_specs, fast: bool):
    calls: list = []
    rec = Recorder()
    logger = logging.getLogger("mitmproxy.addonmanager")
    logger.addHandler(rec)
    try:
        m = new_master()
        if fast:
            assert dispatch.install(m.addons)
        # (chain set directly: AddonManager.add would also deliver load/configure events)
        m.addons.chain = [make_addon(s, calls) for s in chain_specs]
        f = tflow.tflow(resp=True)
        await m.addons.handle_lifecycle(HttpRequestHook(f))
        await m.addons.handle_lifecycle(HttpResponseHook(f))
        m.addons.trigger(hooks.UpdateHook([f]))
        m.addons.trigger(AddLogHook(LogEntry("hello", "info")))
    finally:
        logger.removeHandler(rec)
    return calls, rec.lines


# (the synchronous trigger calls a hook that returns a coroutine and drops it, in mitmproxy too)
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@settings(max_examples=150, deadline=None)
@given(st.lists(specs(), min_size=1, max_size=6))
def test_fast_dispatch_makes_mitmproxys_calls_and_error_lines(chain):
    async def both():
        return await run_chain(chain, False), await run_chain(chain, True)
    (stock_calls, stock_log), (fast_calls, fast_log) = asyncio.run(both())
    assert fast_calls == stock_calls
    assert fast_log == stock_log


def test_options_error_propagates_in_both():
    class Bad:
        def request(self, f):
            raise exceptions.OptionsError("bad option")

    async def go(fast):
        m = new_master()
        if fast:
            dispatch.install(m.addons)
        m.addons.chain = [Bad()]
        await m.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))

    for fast in (False, True):
        with pytest.raises(exceptions.OptionsError):
            asyncio.run(go(fast))


def test_the_chain_is_read_at_every_event_and_uninstall_restores_mitmproxys_methods():
    async def go():
        m = new_master()
        assert dispatch.install(m.addons) and dispatch.install(m.addons)  # idempotent
        seen = []

        class A:
            def request(self, f):
                seen.append("A")
        m.addons.chain = [A()]
        await m.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
        m.addons.chain.append(A())  # an addon added later is reached (nothing cached)
        await m.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
        assert seen == ["A", "A", "A"]
        dispatch.uninstall(m.addons)
        assert not dispatch.install(m.addons, mitmproxy_at="12.1.0")  # another mitmproxy keeps its own
        assert "trigger_event" not in vars(m.addons)
        assert "trigger_event" not in vars(m.addons) and "trigger" not in vars(m.addons)
        assert m.addons.trigger_event.__func__ is type(m.addons).trigger_event
    asyncio.run(go())


def test_mitmdump_with_the_addon_serves_through_the_fast_dispatch_and_can_turn_it_off(tmp_path):
    import json
    import urllib.request

    from tests.addon.procs import fake_backend, mitmdump

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    for setting in ("true", "false"):
        logs = tmp_path / f"logs-{setting}"
        with fake_backend(tmp_path) as be, mitmdump(tmp_path, logs, upstream=be.url, quiet=False,
                                                    sets={"polar_fast_dispatch": setting, "polar_dialect": "vllm"}) as px:
            req = urllib.request.Request(px.url + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json", "x-polar-episode": "d"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200 and json.loads(r.read())["choices"]
        text = px.log.read_text()  # (read once mitmdump has exited: its output is block-buffered)
        assert ("polar: fast addon dispatch on" in text) == (setting == "true"), text[-2000:]
        assert (logs / "d.arrow").exists()
