"""A tiny HTTP server on 127.0.0.1 that answers every POST with prepared bytes, so the official
SDK clients (and their streaming helpers) can read what the translators produced."""
from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server API)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status, body, ctype = self.server.answer
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def replay(status: int, body: bytes, ctype: str):
    """Yields (base_url, http_client) for a server that answers (status, body, ctype)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.answer = (status, body, ctype)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()
    # trust_env=False: a proxy configured in the environment must not see loopback test traffic.
    client = httpx.Client(trust_env=False, timeout=10)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", client
    finally:
        client.close()
        server.shutdown()
        server.server_close()
        thread.join(5)
