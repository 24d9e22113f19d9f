"""The model API's way in, host side: one Unix socket per episode, piped to the episode's proxy only.

A sandbox has no network (bubblewrap --unshare-net, docker --network none). The node listens on a
Unix socket in a per-episode directory that is bind-mounted read-only into the sandbox at
SANDBOX_DIR; inner_forwarder.py (copied into the same directory) turns it back into
http://127.0.0.1:INNER_PORT for the harness. Every connection on the socket goes to one fixed
upstream, the episode's proxy (TCP host:port, parsed once here): nothing the agent sends can choose
another destination. Connections are bounded per episode.
"""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import tempfile
from importlib.resources import files
from pathlib import Path
from urllib.parse import urlsplit

SANDBOX_DIR = "/run/polar"  # where the socket directory appears inside a sandbox
SOCKET_NAME = "api.sock"
FORWARDER_NAME = "forward.py"
INNER_PORT = 18080  # the harness's model API inside the sandbox's own network namespace
MAX_CONNECTIONS = 32
CHUNK = 65536


def upstream_of(url: str) -> tuple[str, int]:
    """(host, port) of the proxy's base URL; only plain http to a loopback or named host."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"the episode's proxy {url!r} is not an http://HOST:PORT URL")
    return parts.hostname, parts.port or 80


def inner_base_url(url: str) -> str:
    """The proxy's base URL as a harness inside a sandbox sees it: only host:port change."""
    parts = urlsplit(url)
    return parts._replace(netloc=f"127.0.0.1:{INNER_PORT}").geturl()


def wrap_argv(python: str, argv: list[str]) -> list[str]:
    """The harness command behind the inner forwarder, as run inside the sandbox."""
    return [python, f"{SANDBOX_DIR}/{FORWARDER_NAME}", str(INNER_PORT), f"{SANDBOX_DIR}/{SOCKET_NAME}", "--", *argv]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


class ApiSocket:
    """One episode's socket directory and the listener piping it to ``upstream``."""

    def __init__(self, upstream: str, max_connections: int = MAX_CONNECTIONS):
        self.host, self.port = upstream_of(upstream)
        self.max_connections = max_connections
        # A short path: a socket's path is limited to 107 bytes, episode directories can be deep.
        self.dir = Path(tempfile.mkdtemp(prefix="polar-api-", dir="/tmp"))
        self.path = self.dir / SOCKET_NAME
        shutil.copyfile(Path(str(files("harness_recipes.runtimes"))) / "inner_forwarder.py", self.dir / FORWARDER_NAME)
        self.active = 0
        self.refused = 0
        self.server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> ApiSocket:
        self.server = await asyncio.start_unix_server(self._handle, path=str(self.path))
        return self

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.active >= self.max_connections:
            self.refused += 1
            writer.close()
            return
        self.active += 1
        task = asyncio.current_task()
        self._conns.add(task)
        up_writer = None
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            sock = up_writer.get_extra_info("socket")
            if sock is not None:  # a relay must not add Nagle's delay to the harness's small writes
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except OSError:
            pass
        finally:
            self.active -= 1
            self._conns.discard(task)
            for w in (writer, up_writer):
                if w is not None:
                    w.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for t in list(self._conns):
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)
            self.server = None
        shutil.rmtree(self.dir, ignore_errors=True)
