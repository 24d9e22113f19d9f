"""Real processes for the addon's end-to-end tests: mitmdump with the addon, and the fake backend.
Every process is started here and stopped by its pid (never by name)."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
MITMDUMP = VENV_BIN / "mitmdump"
FAKE = REPO / "bench" / "fake_backend.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"port {port} not listening after {timeout}s:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Proc:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.contextmanager
def mitmdump(workdir: Path, logdir: Path, *, upstream: str | None = None, sets: dict | None = None,
             mode: str | None = None, addon: bool = True, addon_repo: Path | None = None, quiet: bool = True):
    """mitmdump (+ the addon) as reverse proxy for ``upstream`` (or in ``mode``). ``addon_repo``:
    load the addon of another checkout (the benchmark's before/after comparison) instead."""
    port = free_port()
    log = workdir / f"mitmdump-{port}.log"
    cmd = [str(MITMDUMP), *(["-q"] if quiet else []), "--listen-host", "127.0.0.1", "--listen-port", str(port),
           "--set", f"confdir={workdir / 'mitmconf'}"]
    cmd += ["--mode", mode or f"reverse:{upstream}"]
    if addon:
        cmd += ["-s", str((addon_repo or REPO) / "addon" / "polar_addon.py"), "--set", f"polar_logdir={logdir}"]
    for k, v in (sets or {}).items():
        cmd += ["--set", f"{k}={v}"]
    with open(log, "wb") as out:
        # (the other checkout's packages first, else its polar_addon.py imports this one's)
        env = {**os.environ, "PYTHONPATH": str(addon_repo)} if addon_repo else None
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(workdir), env=env)
    p = Proc(proc, port, log)
    try:
        wait_port(port, proc, log)
        yield p
    finally:
        stop(proc)


@contextlib.contextmanager
def fake_backend(workdir: Path, dialect: str = "vllm", *, chunks: int = 12, gap_ms: float = 0, first_ms: float = 0,
                 tokenizer: str | None = None):
    port = free_port()
    log = workdir / f"fake-{port}.log"
    cmd = [sys.executable, str(FAKE), "--port", str(port), "--dialect", dialect, "--chunks", str(chunks),
           "--gap-ms", str(gap_ms), "--first-ms", str(first_ms)]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    p = Proc(proc, port, log)
    try:
        wait_port(port, proc, log)
        yield p
    finally:
        stop(proc)
