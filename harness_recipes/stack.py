"""Start the capture stack for the demo, the closed loop, the benchmarks and the end-to-end tests.

    with serve(model_dir, script=...) as srv, capture_proxy(srv.url, logdir) as proxy:
        ... polar-rollout ... --proxy proxy.url --logdir logdir

Both are real subprocesses bound to 127.0.0.1 (procs.running), stopped by pid (TERM, then KILL)
when the block exits, whatever way it exits. polar-serve reports its own port; mitmdump gets a
free port we pick and is ready when it accepts a connection.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from importlib.resources import files
from pathlib import Path

from .procs import Proc, free_port, running, venv_bin

SERVE_READY = "polar-serve listening on "


def addon_script() -> Path:
    """The capture addon's mitmproxy script (`mitmdump -s`), from the installed `addon` package."""
    return Path(str(files("addon").joinpath("polar_addon.py")))


@contextlib.contextmanager
def serve(model_dir: Path, script: Path | None = None, dialect: str = "vllm", model_name: str | None = "polar-model",
          extra_args=(), *, log: Path | None = None, timeout: float = 180.0,
          echo: Callable[[str], None] | None = None) -> Iterator[Proc]:
    """polar-serve (CPU, scripted when `script` is given) on a free loopback port; `model_name` None:
    the server's own default name."""
    cmd = [sys.executable, "-m", "polar_serve.cli", "--model", str(model_dir), "--dialect", dialect,
           "--host", "127.0.0.1", "--port", "0", *map(str, extra_args)]
    if model_name is not None:
        cmd += ["--served-model-name", model_name]
    if script is not None:
        cmd += ["--script", str(script)]
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    with running(cmd, log=log, ready_line=SERVE_READY, timeout=timeout, env=env, echo=echo) as p:
        yield p


@contextlib.contextmanager
def mitmdump(*, upstream: str | None = None, mode: str | None = None, logdir: Path | None = None,
             addon: Path | None = None, confdir: Path | None = None, sets: dict | None = None, quiet: bool = True,
             port: int | None = None, log: Path | None = None, cwd: Path | None = None, env: dict | None = None,
             timeout: float = 60.0, echo: Callable[[str], None] | None = None) -> Iterator[Proc]:
    """mitmdump on a loopback port, as reverse proxy for `upstream` (or in `mode`), with the mitmproxy
    script `addon` writing `logdir` (None: bare mitmdump), `--set` options from `sets`."""
    port = port or free_port()
    cmd = [venv_bin("mitmdump"), *(["-q"] if quiet else []), "--listen-host", "127.0.0.1", "--listen-port", str(port),
           "--mode", mode or f"reverse:{upstream}"]
    if confdir is not None:
        cmd += ["--set", f"confdir={confdir}"]
    if addon is not None:
        cmd += ["-s", str(addon), "--set", f"polar_logdir={logdir}"]
    for k, v in (sets or {}).items():
        cmd += ["--set", f"{k}={v}"]
    with running(cmd, log=log, port=port, timeout=timeout, cwd=cwd, env=env, echo=echo) as p:
        yield p


@contextlib.contextmanager
def capture_proxy(upstream: str, logdir: Path, *, confdir: Path | None = None, sets: dict | None = None,
                  log: Path | None = None, timeout: float = 60.0,
                  echo: Callable[[str], None] | None = None) -> Iterator[Proc]:
    """mitmdump with the Polar addon in reverse-proxy mode in front of `upstream`."""
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    with mitmdump(upstream=upstream, logdir=logdir, addon=addon_script(), confdir=confdir,
                  sets={"termlog_verbosity": "warn", **(sets or {})}, log=log, timeout=timeout, echo=echo) as p:
        yield p
