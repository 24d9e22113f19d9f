"""Start and stop the processes of a local stack: the one helper the demo, the closed loop, the
benchmarks and the tests share.

    with running(cmd, log=work / "x.log", port=port) as p:        # ready: the port accepts a connection
        ...
    with running(cmd, ready_line="polar-serve listening on ") as p:  # ready: a line of its output
        p.url                                                     # the rest of that line

A process's output (stdout and stderr together) goes to `log` when given, else into `Proc.lines`
(pumped by a thread, each line also passed to `echo`). Waiting for readiness checks that the process
is still alive, so a crash at startup is an error at once, with the tail of its output. Every
process is stopped by its pid when the block exits, however it exits: `stop` (TERM, then KILL).
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"


@dataclass
class Proc:
    proc: subprocess.Popen
    url: str = ""
    log: Path | None = None  # where the output goes, or None: it is in `lines`
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/")[0])

    @property
    def base_url(self) -> str:  # the name HTTP clients give it
        return self.url

    def output(self) -> str:
        if self.log is not None:
            return self.log.read_text(errors="replace") if self.log.exists() else ""
        return "".join(self.lines)


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def venv_bin(name: str) -> str:
    """A console script of this Python environment (mitmdump, polar-recon), else the name (PATH)."""
    exe = Path(sys.executable).parent / name
    return str(exe) if exe.exists() else name


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Stop one process by its pid: `sig`, then KILL if it is still running after `grace` seconds."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def port_open(port: int, host: str = HOST) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
        return True
    return False


def _pump(stream, sink: list[str], echo: Callable[[str], None] | None) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        if echo:
            echo(line.rstrip())


def _ready_line(p: Proc, prefix: str) -> str | None:
    for line in p.output().splitlines():
        if line.startswith(prefix):
            return line[len(prefix):].strip()
    return None


def wait_ready(p: Proc, *, port: int | None = None, ready_line: str | None = None, timeout: float = 60.0,
               what: str = "") -> None:
    """Until `port` accepts a connection or a line starting with `ready_line` is in the output (its rest
    becomes `p.url`); RuntimeError, with the output's tail, if the process exits or time runs out."""
    what = what or Path(str(p.proc.args[0])).name
    deadline = time.monotonic() + timeout
    while True:
        if ready_line is not None and (rest := _ready_line(p, ready_line)) is not None:
            p.url = rest
            return
        if port is not None and port_open(port):
            return
        if p.proc.poll() is not None:
            raise RuntimeError(f"{what} exited {p.proc.returncode} before it was ready:\n{p.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:g}s:\n{p.output()[-3000:]}")
        time.sleep(0.05)


@contextlib.contextmanager
def running(cmd: list[str], *, log: Path | None = None, port: int | None = None, ready_line: str | None = None,
            timeout: float = 60.0, cwd: str | Path | None = None, env: dict[str, str] | None = None,
            echo: Callable[[str], None] | None = None, stop_signal: int = signal.SIGTERM,
            grace: float = 10.0, what: str = "") -> Iterator[Proc]:
    """Run `cmd` for the duration of the block; yield its Proc once it is ready.

    Ready: `port` (on 127.0.0.1; then `url` is http://127.0.0.1:PORT) accepts a connection, or a line
    of output starts with `ready_line`, or, with neither, at once. `env` defaults to this process's
    environment; PYTHONUNBUFFERED=1 is added either way, so Python children's lines arrive as written.
    """
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    if log is not None:
        log = Path(log)
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env)
        p = Proc(proc, log=log)
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env)
        p = Proc(proc)
        threading.Thread(target=_pump, args=(proc.stdout, p.lines, echo), daemon=True).start()
    if port is not None:
        p.url = f"http://{HOST}:{port}"
    try:
        if port is not None or ready_line is not None:
            wait_ready(p, port=port, ready_line=ready_line, timeout=timeout, what=what)
        yield p
    finally:
        stop(proc, stop_signal, grace)
