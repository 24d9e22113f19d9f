"""The adversarial episode of bench/bench_scale.py: gzip bombs, nested JSON and a connection flood,
sent until stopped, in its own process (imports only aiohttp: it starts in well under a second)."""
from __future__ import annotations

import asyncio
import gzip

import aiohttp

REFUSALS = (400, 413, 429)  # what the adversary's requests may be answered; anything else is an error


def bomb_body(mib: float) -> bytes:
    n = int(mib * 2**20 / 3)
    return gzip.compress(b'{"model":"fake","model":"fake","stream":true,"messages":[' + b"{}," * n + b"{}]}", 6)


class Adversary:
    """One episode sending bombs, nested JSON and a connection flood until stopped."""

    def __init__(self, base: str, url: str, bomb: bytes, flood: int, connect_loop: bool):
        self.base, self.url, self.bomb, self.flood, self.connect_loop = base, url, bomb, flood, connect_loop
        self.statuses: dict[str, int] = {}
        self.errors = 0
        self.connects = 0
        self.stop = asyncio.Event()

    def _count(self, what: str, status: int | None) -> None:
        key = f"{what} {status if status is not None else 'no answer'}"
        self.statuses[key] = self.statuses.get(key, 0) + 1
        self.errors += status not in REFUSALS

    async def _send(self, session, what: str, data: bytes, headers: dict) -> None:
        while not self.stop.is_set():
            try:
                async with session.post(self.url, data=data, headers=headers) as r:
                    await r.read()
                    self._count(what, r.status)
            except (TimeoutError, aiohttp.ClientError):
                self._count(what, None)

    async def _flood(self) -> None:
        host, port = self.base.removeprefix("http://").split(":")
        held = []
        try:
            for _ in range(self.flood):  # idle connections held open for the whole phase
                held.append(await asyncio.open_connection(host, int(port)))
            while self.connect_loop and not self.stop.is_set():  # and connect / close as fast as this loop goes
                _, w = await asyncio.open_connection(host, int(port))
                w.close()
                self.connects += 1
                await asyncio.sleep(0)
        except OSError:
            self.errors += 1
            await self.stop.wait()
        finally:
            for _, w in held:
                w.close()

    async def run(self) -> None:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
            nested = b'{"model":"fake","stream":true,"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            await asyncio.gather(
                self._send(s, "bomb", self.bomb, {"content-type": "application/json", "content-encoding": "gzip"}),
                self._send(s, "nested", nested, {"content-type": "application/json"}),
                self._flood())


def adversary_process(base: str, url: str, bomb_mib: float, flood: int, connect_loop: bool, stop, results) -> None:
    """The adversary in its own process (its client work must not slow the honest load generator's
    event loop: on this machine both still share the cores, as on a node)."""
    async def main():
        adv = Adversary(base, url, bomb_body(bomb_mib), flood, connect_loop)
        task = asyncio.ensure_future(adv.run())
        results.put("ready")
        while not stop.is_set():
            await asyncio.sleep(0.05)
        adv.stop.set()
        await task
        results.put({"adversary": adv.statuses, "adversary_errors": adv.errors, "adversary_connects": adv.connects})
    asyncio.run(main())


def socket_flood_process(path: str, stop, results) -> None:
    """The adversary as a sandboxed agent sees its way out: its episode's model API Unix socket
    (harness_recipes/runtimes/api_socket.py) and nothing else. It connects, sends a request line and
    closes, in a loop as fast as one process goes, until stopped. Blocking connects: when the node stops
    accepting (the episode's connect budget is spent) they wait in the kernel's backlog."""
    import socket
    import time

    connects = refused = 0
    results.put("ready")
    while not stop.is_set():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            try:
                s.connect(path)
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                connects += 1
                refused += s.recv(12).startswith(b"HTTP/1.1 403")
            except OSError:
                time.sleep(0)
    results.put({"adversary": {"socket connects": connects, "answered 403": refused}, "adversary_errors": 0,
                 "adversary_connects": connects})
