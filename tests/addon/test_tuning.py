"""addon/tuning.py: the listen backlog is raised in place on mitmproxy's own sockets."""
from __future__ import annotations

import socket

from addon.tuning import set_backlog


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
            except (socket.timeout, OSError):
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
        assert set_backlog(srv, 64)
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
