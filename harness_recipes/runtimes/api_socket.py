"""The model API's way in, host side: one Unix socket per episode, piped to the episode's proxy only.

A sandbox has no network (bubblewrap --unshare-net, docker --network none). The node listens on a
Unix socket in a per-episode directory that is bind-mounted read-only into the sandbox at
SANDBOX_DIR; inner_forwarder.py (copied into the same directory) turns it back into
http://127.0.0.1:INNER_PORT for the harness. Every connection on the socket goes to one fixed
upstream, the episode's proxy (TCP host:port, parsed once here): nothing the agent sends can choose
another destination. Connections are bounded per episode.

One client: the forwarder. The socket is visible inside the sandbox (the forwarder must reach it),
so an agent's command could connect to it directly and skip the forwarder's check of who calls
(inner_forwarder.py: only the harness talks to the model). The forwarder claims the socket before it
starts the harness, so before any of the agent's code runs: the first connection must be its CLAIM,
and from then on only connections whose SO_PEERCRED pid (as this node's pid namespace sees it, and
with the same start time: no reused pid) is the claimant's are piped. Any other gets an HTTP 403 and
is counted (`refused_peers`); the forwarder's own reports of refused callers are counted too
(`refused_calls`, with the last few reasons in `refusals`).

Connections are also paced per episode (ConnectBudget: CONNECT_RATE a second, CONNECT_BURST at
once). Every connection costs this node's event loop, which serves every episode's socket: a
connect/close loop from inside the sandbox (straight to the socket, or through the forwarder, whose
refusals are reported here) would take it from the siblings. The pacing is at the accept: when an
episode's budget is spent, its socket is not accepted from until a token accrues, so its further
connects wait in the kernel's backlog (then block or fail inside the sandbox) and cost this node
nothing. A harness opens a few connections a second at most; the budget is far above that.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import struct
import tempfile
from importlib.resources import files
from pathlib import Path
from urllib.parse import urlsplit

SANDBOX_DIR = "/run/polar"  # where the socket directory appears inside a sandbox
SOCKET_NAME = "api.sock"
FORWARDER_NAME = "forward.py"
INNER_PORT = 18080  # the harness's model API inside the sandbox's own network namespace
MAX_CONNECTIONS = 32
CONNECT_RATE = 50.0  # connections accepted a second per episode, sustained (ConnectBudget)
CONNECT_BURST = 100  # ... and at once, after a quiet spell
BACKLOG = 64
CHUNK = 65536
# The forwarder's own messages (inner_forwarder.py): no HTTP request starts with a NUL byte.
MAGIC = b"\x00POLAR"
CLAIM = b"claim\n"
REFUSED = b"refused "
MAX_REFUSALS_KEPT = 20


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


def wrap_argv(python: str, argv: list[str], callers: tuple[str, ...] = ()) -> list[str]:
    """The harness command behind the inner forwarder, as run inside the sandbox; ``callers``: the
    recipe's model_callers (the harness's helper processes that may call the model too)."""
    extra = ["--callers", ",".join(callers)] if callers else []
    return [python, f"{SANDBOX_DIR}/{FORWARDER_NAME}", str(INNER_PORT), f"{SANDBOX_DIR}/{SOCKET_NAME}", *extra, "--",
            *argv]


def peer_pid(writer: asyncio.StreamWriter) -> int:
    """The connecting process's pid by SO_PEERCRED (0 when the kernel cannot map it into our namespace)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return 0
    pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid


def start_time(pid: int) -> str | None:
    """The process's start time (/proc/PID/stat field 22): with the pid, an identity a reused pid does not share."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class ConnectBudget:
    """A token bucket, sans-IO: ``take(now)`` takes one connection's token and returns 0.0, or returns
    the seconds until one accrues (taking nothing). ``rate`` tokens a second, at most ``burst`` kept."""

    def __init__(self, rate: float = CONNECT_RATE, burst: int = CONNECT_BURST):
        if rate <= 0 or burst < 1:
            raise ValueError(f"a connect budget needs rate > 0 and burst >= 1, not {rate}, {burst}")
        self.rate, self.burst = float(rate), float(burst)
        self.tokens = self.burst
        self.at: float | None = None

    def take(self, now: float) -> float:
        if self.at is not None:
            self.tokens = min(self.burst, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0 - 1e-9:  # (a token accrued in float steps may read 0.99999...)
            self.tokens = max(0.0, self.tokens - 1.0)
            return 0.0
        return (1.0 - self.tokens) / self.rate


FORBIDDEN = ("HTTP/1.1 403 Forbidden\r\nContent-Type: application/json\r\nConnection: close\r\n"
             "Content-Length: {n}\r\n\r\n{body}")


def forbidden(why: str) -> bytes:
    body = json.dumps({"error": {"type": "polar_model_api_refused", "message": f"polar: {why}"}})
    return FORBIDDEN.format(n=len(body.encode()), body=body).encode()


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

    def __init__(self, upstream: str, max_connections: int = MAX_CONNECTIONS, budget: ConnectBudget | None = None):
        self.host, self.port = upstream_of(upstream)
        self.max_connections = max_connections
        self.budget = budget or ConnectBudget()
        self.paced = 0  # times the accept waited for the budget (a connect loop shows here)
        # A short path: a socket's path is limited to 107 bytes, episode directories can be deep.
        self.dir = Path(tempfile.mkdtemp(prefix="polar-api-", dir="/tmp"))
        self.path = self.dir / SOCKET_NAME
        shutil.copyfile(Path(str(files("harness_recipes.runtimes"))) / "inner_forwarder.py", self.dir / FORWARDER_NAME)
        self.active = 0
        self.refused = 0  # over the connection bound
        self.owner: tuple[int, str | None] | None = None  # the forwarder: (pid, start time), once it claimed
        self.refused_peers = 0  # connections from any other process (straight to the socket)
        self.refused_calls = 0  # connections the forwarder refused (not the harness's), as it reported them
        self.refusals: list[str] = []  # the last few reasons, for the episode's record
        self.server: socket.socket | None = None  # the listening socket
        self._accepter: asyncio.Task | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> ApiSocket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self.server = sock
        self._accepter = asyncio.create_task(self._accept_loop(sock))
        return self

    async def _accept_loop(self, sock: socket.socket) -> None:
        """Accept at the episode's pace (ConnectBudget); each connection handled in its own task."""
        loop = asyncio.get_running_loop()
        while True:
            while (wait := self.budget.take(loop.time())) > 0:
                self.paced += 1
                await asyncio.sleep(wait)
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError:
                return  # the listener was closed
            try:
                reader, writer = await asyncio.open_unix_connection(sock=conn)
            except OSError:
                conn.close()
                continue
            task = asyncio.create_task(self._handle(reader, writer))
            self._conns.add(task)
            task.add_done_callback(self._conns.discard)

    def _note(self, why: str) -> None:
        self.refusals = (self.refusals + [why[:300]])[-MAX_REFUSALS_KEPT:]

    def refused_metadata(self) -> dict:
        """The episode record's account of model calls refused: not the harness's (the forwarder's
        count), or not through the forwarder at all."""
        return {"refused_calls": self.refused_calls, "refused_peers": self.refused_peers,
                **({"refusals": list(self.refusals)} if self.refusals else {}),
                **({"paced_accepts": self.paced} if self.paced else {})}

    async def _control(self, reader, writer, pid: int, start: bytes) -> None:
        """The forwarder's CLAIM or REFUSED report (``start``: what of its line was read already)."""
        line = start if start.endswith(b"\n") else start + await asyncio.wait_for(reader.readline(), 10)
        if line == CLAIM and self.owner is None:
            self.owner = (pid, start_time(pid))
            writer.write(b"OK\n")
        elif line.startswith(REFUSED) and self.owner == (pid, start_time(pid)):
            self.refused_calls += 1
            try:
                self._note(str(json.loads(line[len(REFUSED):]).get("why", "")))
            except ValueError:
                self._note("(unreadable report)")
            writer.write(b"OK\n")
        else:
            self.refused_peers += 1
            self._note(f"pid {pid}: a forwarder message not from the forwarder")
            writer.write(b"NO\n")
        await writer.drain()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.active >= self.max_connections:
            self.refused += 1
            writer.close()
            return
        self.active += 1
        up_writer = None
        try:
            pid = peer_pid(writer)
            head = await asyncio.wait_for(reader.read(CHUNK), 60)
            while head and len(head) < len(MAGIC) and MAGIC.startswith(head):  # a message split early
                more = await asyncio.wait_for(reader.read(CHUNK), 10)
                if not more:
                    break
                head += more
            if head.startswith(MAGIC):
                await self._control(reader, writer, pid, head[len(MAGIC):])
                return
            if not head:
                return  # connected and closed, or sent nothing: no upstream connection for it
            if self.owner is None or (pid, start_time(pid)) != self.owner:
                self.refused_peers += 1
                why = (f"pid {pid} connected to the model API socket directly; only the sandbox's forwarder may, "
                       "and only for the harness")
                self._note(why)
                writer.write(forbidden(why))
                await writer.drain()
                return
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
            up_writer.write(head)
            sock = up_writer.get_extra_info("socket")
            if sock is not None:  # a relay must not add Nagle's delay to the harness's small writes
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self.active -= 1
            for w in (writer, up_writer):
                if w is not None:
                    w.close()

    async def close(self) -> None:
        if self.server is not None:
            tasks = [t for t in (self._accepter, *self._conns) if t is not None]
            for t in tasks:
                t.cancel()
            self.server.close()
            self.server = None
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 2)
        shutil.rmtree(self.dir, ignore_errors=True)
