"""The model API forwarders (runtimes/api_socket.py, inner_forwarder.py), on their own: fast, no sandbox."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from harness_recipes.runtimes.api_socket import ApiSocket, inner_base_url, upstream_of

FORWARDER = __import__("harness_recipes.runtimes.inner_forwarder", fromlist=["x"]).__file__


def test_upstream_and_base_url():
    assert upstream_of("http://127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert inner_base_url("http://127.0.0.1:8080/polar/e1") == "http://127.0.0.1:18080/polar/e1"
    for bad in ("https://127.0.0.1:8080", "127.0.0.1:8080", "http://"):
        with pytest.raises(ValueError, match="not an http://HOST:PORT URL"):
            upstream_of(bad)


async def _echo_upstream():
    hits = []

    async def handle(reader, writer):
        hits.append(1)
        while data := await reader.read(1024):
            writer.write(data.upper())
            await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], hits


def test_socket_pipes_to_its_one_upstream_and_is_bounded():
    async def go():
        server, port, hits = await _echo_upstream()
        api = await ApiSocket(f"http://127.0.0.1:{port}", max_connections=2).start()
        try:
            held = [await asyncio.open_unix_connection(str(api.path)) for _ in range(2)]
            for r, w in held:
                w.write(b"hi")
                await w.drain()
                assert await r.readexactly(2) == b"HI"
            r3, w3 = await asyncio.open_unix_connection(str(api.path))
            assert await asyncio.wait_for(r3.read(10), 5) == b""  # over the bound: closed at once
            assert api.refused == 1 and len(hits) == 2
            for _, w in held:
                w.close()
        finally:
            await api.close()
            server.close()
        assert not api.dir.exists()
    asyncio.run(go())


def test_inner_forwarder_lives_as_long_as_the_harness(tmp_path):
    """It serves while its child runs, exits with the child's status, and its port closes with it."""
    async def go():
        server, port, _ = await _echo_upstream()
        api = await ApiSocket(f"http://127.0.0.1:{port}").start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            inner = s.getsockname()[1]
        child = ("import socket, sys; c = socket.create_connection(('127.0.0.1', int(sys.argv[1])));"
                 "c.sendall(b'ping'); c.shutdown(socket.SHUT_WR); print(c.recv(10).decode()); sys.exit(3)")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, FORWARDER, str(inner), str(api.path), "--", sys.executable, "-c", child, str(inner),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        await api.close()
        server.close()
        return proc.returncode, out.decode(), err.decode(), inner
    rc, out, err, inner = asyncio.run(go())
    assert rc == 3 and out.strip() == "PING", (rc, out, err)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", inner), timeout=2)
