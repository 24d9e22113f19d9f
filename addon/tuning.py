"""Process-level settings that keep mitmdump out of the way under agent load (one addon class).

Two costs of a stock mitmdump that the capture path makes worse, measured in bench/bench_proxy.py:

- Listen backlog: mitmproxy listens through ``asyncio.start_server``, whose backlog is 100. A
  rollout node opening 256 connections at once overflows it while the event loop is busy; the
  kernel then drops the handshake's last ACK and the harness's first bytes get a reset
  ("connection reset by peer"). Calling ``listen()`` again on a listening socket only changes
  its backlog (Linux, BSD, macOS), so the proxy keeps its sockets and mitmproxy its servers.
- The cyclic garbage collector: every full collection walks every object alive, ~100k of them
  after mitmproxy's start-up (its addons, option tables, certificate store), while the objects a
  call creates (parsed JSON, id lists) are acyclic and freed by reference counting anyway.
  ``gc.freeze()`` once the proxy runs moves the start-up objects out of the collector's sight, so
  collections cost what the calls in flight cost. Nothing is leaked: frozen objects are the ones
  that live for the whole process.
"""
from __future__ import annotations

import gc
import logging
import socket

from mitmproxy import ctx, exceptions

log = logging.getLogger("polar")


def listening_sockets() -> list:
    """The TCP sockets mitmproxy's proxy servers listen on (asyncio TransportSocket objects)."""
    ps = ctx.master.addons.get("proxyserver")
    out = []
    for instance in getattr(ps, "servers", None) or ():
        for server in getattr(instance, "_servers", ()):
            out.extend(getattr(server, "sockets", None) or ())
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


class Tuning:
    def load(self, loader) -> None:
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
        backlog = ctx.options.polar_listen_backlog
        if backlog:
            socks = listening_sockets()
            raised = [s for s in socks if set_backlog(s, backlog)]
            if raised:
                log.info("polar: listen backlog %d on %s", backlog,
                         ", ".join(f"{a[0]}:{a[1]}" for a in (s.getsockname() for s in raised)))
            if len(raised) < len(socks):
                log.warning("polar: could not raise the listen backlog of %d of %d sockets",
                            len(socks) - len(raised), len(socks))
        if ctx.options.polar_gc_freeze:
            gc.collect()
            gc.freeze()
