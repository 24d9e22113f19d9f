"""Start polar-serve for tests: the cached tiny model and a context manager around the server.

    from tests.support.servers import tiny_model_dir, polar_serve
    with polar_serve(tiny_model_dir(), "vllm", script="data/scripts/create_hello.json") as srv:
        httpx.post(srv.base_url + "/v1/chat/completions", json=...)

The server is a real subprocess (`python -m polar_serve.cli`), bound to 127.0.0.1 on a free port
(`--port 0`; the port is read from its `polar-serve listening on ...` line) and killed by pid
when the block exits.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness_recipes.stack import stop

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "tiny-qwen3"
READY_PREFIX = "polar-serve listening on "
TINY_SEED = 0


def tiny_model_dir(seed: int = TINY_SEED) -> Path:
    """Build the tiny random Qwen3 once (under a file lock, for parallel test processes); return its dir."""
    from polar_serve.tiny import ensure_tiny

    return ensure_tiny(CACHE if seed == TINY_SEED else CACHE.with_name(f"tiny-qwen3-seed{seed}"), seed=seed)


@dataclass
class ServeHandle:
    proc: subprocess.Popen
    host: str
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return "".join(self.log)


def _pump(stream, sink: list[str]) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)


@contextlib.contextmanager
def polar_serve(model_dir, dialect: str = "vllm", script=None, extra_args=(), timeout: float = 120.0):
    """Run polar-serve as a subprocess for the duration of the block; yield a ServeHandle."""
    cmd = [sys.executable, "-m", "polar_serve.cli", "--model", str(model_dir), "--dialect", dialect,
           "--host", "127.0.0.1", "--port", "0", *map(str, extra_args)]
    if script is not None:
        cmd += ["--script", str(script)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    handle = None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                if proc.poll() is not None:
                    break
                continue
            lines.append(line)
            if line.startswith(READY_PREFIX):
                url = line[len(READY_PREFIX):].strip()
                host, port = url.removeprefix("http://").rsplit(":", 1)
                handle = ServeHandle(proc, host, int(port), lines)
                break
        if handle is None:
            raise RuntimeError(f"polar-serve did not start (exit {proc.poll()}):\n{''.join(lines)}")
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        yield handle
    finally:
        stop(proc, grace=10)
