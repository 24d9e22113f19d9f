"""Serve an aiohttp app on loopback and announce its address: polar-serve and the forced-replies
shim (harness_recipes/demo/forced_replies.py) both start this way. aiohttp only (no torch), so a light
process that imports it stays light."""
from __future__ import annotations

import asyncio

from aiohttp import web


async def serve_forever(app: web.Application, host: str, port: int, ready: str) -> int:
    """Serve `app` on host:port (0: a free port) until cancelled; once listening, print `ready`
    followed by the base URL (what harness_recipes.node.processes waits for)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    real_port = site._server.sockets[0].getsockname()[1]
    print(f"{ready}http://{host}:{real_port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
    return 0
