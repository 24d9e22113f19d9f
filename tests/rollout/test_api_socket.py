"""The model API forwarders (runtimes/api_socket.py, inner_forwarder.py), on their own: fast, no sandbox.
Real sockets and real processes: who holds a connection is read from the kernel's tables."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.runtimes import inner_forwarder
from harness_recipes.runtimes.api_socket import CLAIM, MAGIC, ApiSocket, inner_base_url, upstream_of, wrap_argv

FORWARDER = inner_forwarder.__file__


async def claim(api: ApiSocket) -> None:
    """Claim the socket for this process, as the forwarder does before it starts the harness."""
    r, w = await asyncio.open_unix_connection(str(api.path))
    w.write(MAGIC + CLAIM)
    assert await r.readline() == b"OK\n"
    w.close()


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
            await claim(api)
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


def test_wrap_argv_passes_the_recipes_model_callers():
    argv = wrap_argv("python3", ["codex", "exec"], ("codex",))
    assert argv[-5:] == ["--callers", "codex", "--", "codex", "exec"]
    assert inner_forwarder.parse(argv[2:]) == (18080, "/run/polar/api.sock", ("codex",), ["codex", "exec"])
    assert inner_forwarder.parse(["1", "s", "--", "x"]) == (1, "s", (), ["x"])
    with pytest.raises(ValueError):
        inner_forwarder.parse(["1", "s", "--bad", "x", "--", "y"])


# A process that connects to PORT, says so on stdout, and holds the connection until stdin closes.
HOLD = ("import socket, sys; c = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
        "print('connected', flush=True); sys.stdin.read()")


def _accept_from(server: socket.socket, argv: list[str]):
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "connected"
    conn, addr = server.accept()
    return proc, conn, addr


def test_the_connections_owner_is_found_from_the_kernels_tables(tmp_path):
    """judge(): the harness's own connection passes; its shell's child's does not, whatever it is named;
    a declared model caller passes only as the harness's direct child."""
    server = socket.create_server(("127.0.0.1", 0))
    local = ("127.0.0.1", server.getsockname()[1])
    port = str(local[1])
    py = Path(sys.executable).name
    try:
        # 1. the harness itself holds the connection
        harness, conn, addr = _accept_from(server, [sys.executable, "-c", HOLD, port])
        why, pids = inner_forwarder.judge(addr, local, harness.pid, ())
        assert why == "" and pids == {harness.pid}
        # the same connection judged for another harness pid: refused, naming the holder
        why, _ = inner_forwarder.judge(addr, local, harness.pid + 100000, ())
        assert f"pids [{harness.pid}]" in why and "not from the harness" in why
        harness.stdin.close(), harness.wait(), conn.close()
        # 2. a command the harness's shell tool runs: a grandchild through bash
        script = tmp_path / "hold.py"
        script.write_text(HOLD)
        tool = "import subprocess, sys; sys.exit(subprocess.call(['bash', '-c', sys.argv[1]]))"
        shell, conn, addr = _accept_from(server, [sys.executable, "-c", tool, f"{sys.executable} {script} {port}; true"])
        why, pids = inner_forwarder.judge(addr, local, shell.pid, (py, "bash"))
        assert "not from the harness" in why and shell.pid not in pids, (why, pids)  # named, but not a direct child
        shell.stdin.close(), shell.wait(), conn.close()
        # 3. a declared helper, the harness's direct child: allowed by name only
        launcher = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]]); "
                    "sys.exit(p.wait())")
        parent, conn, addr = _accept_from(server, [sys.executable, "-c", launcher, HOLD, port])
        helper = (inner_forwarder.holders(inner_forwarder.socket_inode(addr, local)) or {0}).pop()
        assert inner_forwarder.parent_of(helper) == parent.pid
        assert inner_forwarder.judge(addr, local, parent.pid, (py,))[0] == ""
        assert "not from the harness" in inner_forwarder.judge(addr, local, parent.pid, ("node",))[0]
        parent.stdin.close(), parent.wait(), conn.close()
    finally:
        server.close()


def test_only_the_harness_reaches_the_model_through_the_forwarder(tmp_path):
    """End to end, real processes: the forwarder's child (the harness) calls and is answered; a command
    it runs through a shell gets an HTTP 403 saying why, and the host end counts it; a process that
    connects to the Unix socket itself, past the forwarder, is refused and counted too."""
    agent = tmp_path / "agent_call.py"
    agent.write_text(
        "import socket, sys\n"
        "c = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
        "c.sendall(b'POST /v1/chat/completions HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 0\\r\\n\\r\\n')\n"
        "print(c.recv(4096).decode(errors='replace'))\n")
    harness = ("import socket, subprocess, sys\n"
               "port = int(sys.argv[1])\n"
               "c = socket.create_connection(('127.0.0.1', port)); c.sendall(b'ping'); c.shutdown(socket.SHUT_WR)\n"
               "print('harness:', c.recv(10).decode())\n"
               "out = subprocess.run(['bash', '-c', sys.executable + ' ' + sys.argv[2] + ' ' + str(port)],\n"
               "                     capture_output=True, text=True).stdout\n"
               "print('agent:', out)\n")

    async def go():
        server, port, hits = await _echo_upstream()
        api = await ApiSocket(f"http://127.0.0.1:{port}").start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            inner = s.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, FORWARDER, str(inner), str(api.path), "--", sys.executable, "-c", harness, str(inner),
            str(agent), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        # past the forwarder: straight to the socket from this (not the claimant's) process
        r, w = await asyncio.open_unix_connection(str(api.path))
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")
        direct = await asyncio.wait_for(r.read(), 10)
        w.close()
        meta = api.refused_metadata()
        await api.close()
        server.close()
        return proc.returncode, out.decode(), err.decode(), direct.decode(), meta, len(hits)
    rc, out, err, direct, meta, hits = asyncio.run(go())
    assert rc == 0, (out, err)
    assert "harness: PING" in out, out
    assert "agent: HTTP/1.1 403 Forbidden" in out and "only the harness talks to the model" in out, out
    assert direct.startswith("HTTP/1.1 403") and "directly" in direct, direct
    assert meta["refused_calls"] == 1 and meta["refused_peers"] == 1, meta
    assert hits == 1  # only the harness's connection reached the upstream
    assert any("not from the harness" in r for r in meta["refusals"]), meta


def test_a_second_claim_is_refused(tmp_path):
    async def go():
        server, port, _ = await _echo_upstream()
        api = await ApiSocket(f"http://127.0.0.1:{port}").start()
        try:
            await claim(api)
            r, w = await asyncio.open_unix_connection(str(api.path))
            w.write(MAGIC + CLAIM)
            answer = await r.readline()
            w.close()
            return answer, api.refused_peers
        finally:
            await api.close()
            server.close()
    assert asyncio.run(go()) == (b"NO\n", 1)


# -- pacing: a connect loop from one sandbox costs the node what the budget allows, no more -----------
def test_connect_budget_is_a_token_bucket():
    from harness_recipes.runtimes.api_socket import ConnectBudget

    b = ConnectBudget(rate=10.0, burst=3)
    assert [b.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst at once
    assert b.take(100.0) == pytest.approx(0.1)  # then one token per 1/rate s; nothing taken while waiting
    assert b.take(100.05) == pytest.approx(0.05)
    assert b.take(100.1) == 0.0 and b.take(100.1) == pytest.approx(0.1)
    assert [b.take(200.0) for _ in range(4)][:3] == [0.0] * 3 and b.tokens < 1  # refills to the burst only
    assert b.take(99.0) > 0  # a clock that goes back adds nothing
    for rate, burst in ((0, 1), (1, 0), (-1, 5)):
        with pytest.raises(ValueError, match="rate > 0 and burst >= 1"):
            ConnectBudget(rate, burst)


def _connect_loop(path: str, seconds: float) -> int:
    """A connect/close loop as fast as one process goes (blocking connects: a full backlog waits)."""
    import time
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.2)
            try:
                s.connect(path)
                n += 1
            except OSError:
                pass
    return n


def test_a_connect_loop_is_paced_and_a_sibling_is_served_meanwhile():
    """One episode's socket under a connect/close loop (the loop in a thread: its own process would do
    the same) accepts about burst + rate x seconds connections, opens no upstream connection for any
    (they sent nothing), and a sibling episode's socket in the same event loop answers at once."""
    from harness_recipes.runtimes.api_socket import ConnectBudget

    async def go():
        server, port, hits = await _echo_upstream()
        flooded = await ApiSocket(f"http://127.0.0.1:{port}", budget=ConnectBudget(rate=20.0, burst=10)).start()
        sibling = await ApiSocket(f"http://127.0.0.1:{port}").start()
        try:
            await claim(flooded)
            await claim(sibling)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            flood = asyncio.create_task(asyncio.to_thread(_connect_loop, str(flooded.path), 2.0))
            await asyncio.sleep(0.5)
            worst = 0.0
            for _ in range(5):  # the sibling's calls while the loop runs
                t = loop.time()
                r, w = await asyncio.open_unix_connection(str(sibling.path))
                w.write(b"ping")
                await w.drain()
                assert await asyncio.wait_for(r.readexactly(4), 5) == b"PING"
                w.close()
                worst = max(worst, loop.time() - t)
                await asyncio.sleep(0.1)
            connects = await flood
            elapsed = loop.time() - t0
            await asyncio.sleep(0.2)
            return connects, elapsed, worst, flooded.paced, flooded.refused_metadata(), len(hits)
        finally:
            await flooded.close()
            await sibling.close()
            server.close()
    connects, elapsed, worst, paced, meta, upstream = asyncio.run(go())
    # accepted: the claim, the burst and 20 a second (+ the backlog's 64 queued, never accepted)
    accepted_most = 1 + 10 + 20 * elapsed + 2
    assert paced > 0 and meta["paced_accepts"] == paced, meta
    assert connects <= accepted_most + 64 + 2, (connects, elapsed)  # the rest waited in the sandbox
    assert upstream == 5, upstream  # the sibling's five calls; none for the loop's empty connections
    assert worst < 1.0, worst
