"""Open a page in headless Chromium over the DevTools protocol (aiohttp's websocket client, already a
dependency): collect console errors and uncaught exceptions, evaluate a JS expression once the page
has loaded, take a full-page screenshot. Chromium runs on 127.0.0.1 with a throwaway profile and no
network (the page must work offline), and is stopped by its pid."""
from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class PageResult:
    errors: list[str] = field(default_factory=list)  # console errors, exceptions, failed loads
    value: object = None  # the expression's value
    screenshot: bytes = b""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


async def _session(ws_url: str, url: str, expression: str, width: int, height: int, settle: float) -> PageResult:
    import aiohttp

    res = PageResult()
    async with aiohttp.ClientSession() as http, http.ws_connect(ws_url, max_msg_size=0) as ws:
        seq = 0
        waiters: dict[int, asyncio.Future] = {}
        loaded = asyncio.get_running_loop().create_future()

        async def reader():
            async for msg in ws:
                m = json.loads(msg.data)
                if "id" in m and m["id"] in waiters:
                    waiters.pop(m["id"]).set_result(m)
                method, p = m.get("method"), m.get("params", {})
                if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                    res.errors.append("console: " + " ".join(str(a.get("value", a.get("description")))
                                                             for a in p.get("args", [])))
                elif method == "Runtime.exceptionThrown":
                    d = p.get("exceptionDetails", {})
                    res.errors.append(f"exception: {d.get('text')} {d.get('exception', {}).get('description', '')}")
                elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                    res.errors.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
                elif method == "Page.loadEventFired" and not loaded.done():
                    loaded.set_result(True)

        task = asyncio.create_task(reader())

        async def call(method, **params):
            nonlocal seq
            seq += 1
            fut = asyncio.get_running_loop().create_future()
            waiters[seq] = fut
            await ws.send_str(json.dumps({"id": seq, "method": method, "params": params}))
            m = await asyncio.wait_for(fut, 60)
            if "error" in m:
                raise RuntimeError(f"{method}: {m['error']}")
            return m.get("result", {})

        for d in ("Runtime.enable", "Log.enable", "Page.enable"):
            await call(d)
        await call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        await call("Page.navigate", url=url)
        await asyncio.wait_for(loaded, 60)
        await asyncio.sleep(settle)  # plotly draws after load
        r = await call("Runtime.evaluate", expression=expression, returnByValue=True)
        res.value = r.get("result", {}).get("value")
        shot = await call("Page.captureScreenshot", format="png", captureBeyondViewport=False)
        res.screenshot = base64.b64decode(shot["data"])
        task.cancel()
    return res


def open_page(path: Path, expression: str, *, width: int = 1400, height: int = 1000, settle: float = 2.0,
              exe: str | None = None) -> PageResult:
    exe = exe or chromium()
    if exe is None:
        raise FileNotFoundError("chromium not installed")
    profile = tempfile.mkdtemp(prefix="polar-chromium-")
    proc = subprocess.Popen(
        [exe, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--remote-debugging-address=127.0.0.1",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        port, deadline = None, time.monotonic() + 60
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line and proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode} before its DevTools endpoint was up")
            m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
            if m:
                port = int(m.group(1))
        if port is None:
            raise RuntimeError("chromium printed no DevTools endpoint within 60 s")

        async def go():
            import aiohttp

            async with aiohttp.ClientSession() as http:
                async with http.put(f"http://127.0.0.1:{port}/json/new?about:blank") as r:
                    target = await r.json(content_type=None)
            return await _session(target["webSocketDebuggerUrl"], path.resolve().as_uri(), expression, width, height,
                                  settle)
        return asyncio.run(go())
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":  # python -m tests.support.chromium PAGE.html OUT.png [HEIGHT]: how docs/*.png are made
    import sys

    r = open_page(Path(sys.argv[1]), "document.body.scrollHeight",
                  height=int(sys.argv[3]) if len(sys.argv) > 3 else 1600, settle=3.0)
    if r.errors:
        raise SystemExit(f"console errors: {r.errors}")
    Path(sys.argv[2]).write_bytes(r.screenshot)
    print(f"wrote {sys.argv[2]} (page height {r.value}px)")
