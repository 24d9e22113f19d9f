"""Start the capture stack for the demo, the benchmark and the end-to-end tests.

    with serve(model_dir, script=...) as srv, capture_proxy(srv.url, logdir) as proxy:
        ... polar-rollout ... --proxy proxy.url --logdir logdir

Both are real subprocesses bound to 127.0.0.1, stopped by pid (TERM, then KILL) when the block
exits, whatever way it exits. polar-serve reports its own port; mitmdump gets a free port we
pick and is ready when it accepts a connection.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVE_READY = "polar-serve listening on "


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str
    lines: list[str] = field(default_factory=list)

    def output(self) -> str:
        return "".join(self.lines)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, sink: list[str], echo) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if echo:
            echo(line.rstrip())


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def _bin(name: str) -> str:
    exe = Path(sys.executable).parent / name
    return str(exe) if exe.exists() else name


@contextlib.contextmanager
def serve(model_dir: Path, script: Path | None = None, dialect: str = "vllm", model_name: str = "polar-model",
          timeout: float = 180.0, echo=None):
    """polar-serve (CPU, scripted when `script` is given) on a free loopback port."""
    cmd = [sys.executable, "-m", "polar_serve.cli", "--model", str(model_dir), "--dialect", dialect,
           "--host", "127.0.0.1", "--port", "0", "--served-model-name", model_name]
    if script is not None:
        cmd += ["--script", str(script)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        url = None
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            lines.append(line)
            if line.startswith(SERVE_READY):
                url = line[len(SERVE_READY):].strip()
        if url is None:
            raise RuntimeError(f"polar-serve did not start (exit {proc.poll()}):\n{''.join(lines)[-3000:]}")
        threading.Thread(target=_pump, args=(proc.stdout, lines, echo), daemon=True).start()
        yield Proc(proc, url, lines)
    finally:
        stop(proc)


def _wait_port(port: int, proc: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return True
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def capture_proxy(upstream: str, logdir: Path, timeout: float = 60.0, echo=None):
    """mitmdump with the Polar addon in reverse-proxy mode in front of `upstream`."""
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [_bin("mitmdump"), "-q", "-s", str(ROOT / "addon" / "polar_addon.py"), "--mode", f"reverse:{upstream}",
           "--listen-host", "127.0.0.1", "--listen-port", str(port), "--set", f"polar_logdir={logdir}",
           "--set", "termlog_verbosity=warn"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=_pump, args=(proc.stdout, lines, echo), daemon=True).start()
    try:
        if not _wait_port(port, proc, timeout):
            raise RuntimeError(f"mitmdump did not start (exit {proc.poll()}):\n{''.join(lines)[-3000:]}")
        yield Proc(proc, f"http://127.0.0.1:{port}", lines)
    finally:
        stop(proc)
