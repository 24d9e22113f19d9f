"""addon/mitmproxy_patches.py.

The fast dispatch makes exactly mitmproxy's calls, in mitmproxy's order, with mitmproxy's error
handling: random addon chains run through a stock AddonManager and a fast one side by side; every
hook call, every awaited coroutine and every error log line must match. The listen backlog is
raised in place on mitmproxy's own sockets. A patch whose mitmproxy internals are missing, or
that runs on another mitmproxy, is skipped with a warning: never silently, never a crash."""
from __future__ import annotations

import asyncio
import logging
import socket
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mitmproxy import exceptions, hooks, options
from mitmproxy.log import AddLogHook, LogEntry
from mitmproxy.master import Master
from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
from mitmproxy.test import tflow

from addon import mitmproxy_patches as patches

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
            assert patches.install_fast_dispatch(m.addons)
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
            patches.install_fast_dispatch(m.addons)
        m.addons.chain = [Bad()]
        await m.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))

    for fast in (False, True):
        with pytest.raises(exceptions.OptionsError):
            asyncio.run(go(fast))


def test_the_chain_is_read_at_every_event_and_uninstall_restores_mitmproxys_methods():
    async def go():
        m = new_master()
        assert patches.install_fast_dispatch(m.addons) and patches.install_fast_dispatch(m.addons)  # idempotent
        seen = []

        class A:
            def request(self, f):
                seen.append("A")
        m.addons.chain = [A()]
        await m.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
        m.addons.chain.append(A())  # an addon added later is reached (nothing cached)
        await m.addons.handle_lifecycle(HttpRequestHook(tflow.tflow()))
        assert seen == ["A", "A", "A"]
        patches.uninstall_fast_dispatch(m.addons)
        assert not patches.install_fast_dispatch(m.addons, mitmproxy_at="12.1.0")  # another mitmproxy keeps its own
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
        sets = {"polar_fast_dispatch": setting, "polar_dialect": "vllm"}
        with fake_backend(tmp_path) as be, mitmdump(tmp_path, logs, upstream=be.url, quiet=False, sets=sets) as px:
            req = urllib.request.Request(px.url + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json", "x-polar-episode": "d"})
            with urllib.request.urlopen(req, timeout=10) as r:
                assert r.status == 200 and json.loads(r.read())["choices"]
        text = px.log.read_text()  # (read once mitmdump has exited: its output is block-buffered)
        assert ("polar: fast addon dispatch on" in text) == (setting == "true"), text[-2000:]
        assert (logs / "d.arrow").exists()


# ---------------------------------------------------------------------------------------------
# a patch that cannot apply: a warning, mitmproxy left as it is, no crash


def test_fast_dispatch_on_another_mitmproxy_or_without_its_attributes_warns_and_changes_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="polar")

    class OldManager:  # an AddonManager without the methods the patch replaces
        chain: list = []

    m = OldManager()
    assert not patches.install_fast_dispatch(m)
    assert vars(m) == {}
    assert "fast dispatch patch (polar_fast_dispatch) skipped: the AddonManager has no trigger_event, trigger" \
        in caplog.text
    caplog.clear()

    async def go():
        manager = new_master().addons
        assert not patches.install_fast_dispatch(manager, mitmproxy_at="12.1.0")
        assert "trigger_event" not in vars(manager)
    asyncio.run(go())
    assert "this is mitmproxy 12.1.0" in caplog.text and "skipped" in caplog.text


def test_listen_backlog_without_mitmproxys_private_servers_list_warns_and_changes_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="polar")

    class Instance:  # a server instance whose asyncio servers are not where 11.0.x keeps them
        listen_addrs = [("127.0.0.1", 1)]

    class ProxyServer:
        servers = [Instance()]

    assert patches.raise_listen_backlog(ProxyServer(), 1024) == []
    assert "listen backlog patch (polar_listen_backlog) skipped: server instance Instance has no _servers" \
        in caplog.text
    caplog.clear()
    assert patches.raise_listen_backlog(object(), 1024) == []
    assert "the proxyserver addon has no servers" in caplog.text
    caplog.clear()
    assert patches.raise_listen_backlog(None, 1024) == []
    assert "mitmproxy has no proxyserver addon" in caplog.text
    caplog.clear()
    assert patches.raise_listen_backlog(ProxyServer(), 1024, mitmproxy_at="12.1.0") == []
    assert "this is mitmproxy 12.1.0" in caplog.text


def test_listen_backlog_reaches_the_sockets_of_mitmproxy_11s_server_instances():
    from mitmproxy.proxy.mode_servers import AsyncioServerInstance

    assert "_servers" in AsyncioServerInstance.__annotations__  # the private attribute the patch reads

    class Server:
        def __init__(self, sock):
            self.sockets = [sock]

    class Instance:
        def __init__(self, sock):
            self._servers = [Server(sock)]

    class ProxyServer:
        def __init__(self, sock):
            self.servers = [Instance(sock)]

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        assert patches.raise_listen_backlog(ProxyServer(srv), 64) == [srv]


# ---------------------------------------------------------------------------------------------
# listen backlog


def _connects(port: int, n: int, timeout: float = 0.3) -> int:
    """How many of n connections complete their handshake while nobody calls accept()."""
    ok, socks = 0, []
    try:
        for _ in range(n):
            c = socket.socket()
            c.settimeout(timeout)
            socks.append(c)
            try:
                c.connect(("127.0.0.1", port))
                ok += 1
            except (TimeoutError, OSError):
                pass
    finally:
        for c in socks:
            c.close()
    return ok


def test_set_backlog_raises_the_accept_queue_of_a_listening_socket():
    # control: a queue of 1 holds two handshakes, the third SYN is dropped (connect times out)
    with socket.socket() as small:
        small.bind(("127.0.0.1", 0))
        small.listen(1)
        assert _connects(small.getsockname()[1], 6) < 6
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        assert patches.set_backlog(srv, 64)
        assert _connects(srv.getsockname()[1], 20) == 20
        # still the same listening socket: it accepts
        c = socket.create_connection(srv.getsockname(), timeout=1)
        conn, _ = srv.accept()
        conn.close()
        c.close()


def test_mitmdump_with_the_addon_listens_with_the_raised_backlog(tmp_path):
    from tests.addon.procs import fake_backend, mitmdump

    with fake_backend(tmp_path) as be, mitmdump(tmp_path, tmp_path / "logs", upstream=be.url,
                                                quiet=False) as px:
        pass
    text = px.log.read_text()  # (mitmdump's output is block-buffered: read once it has exited)
    assert f"polar: listen backlog 1024 on 127.0.0.1:{px.port}" in text, text[-2000:]
    assert "skipped" not in text, text[-2000:]  # every patch applies on the pinned mitmproxy
