"""The real vLLM with scripted replies: the ForcedReply plugin inside it and the scripting shim
(forced_replies.py) in front, the demo's counterpart of local_stack.serve(model_dir, script=...).

Real subprocesses on 127.0.0.1, stopped by pid when the block exits (node/processes.running).
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from harness_recipes.demo.forced_replies import READY, vllm_plugin_args, vllm_plugin_env
from harness_recipes.node.local_stack import vllm
from harness_recipes.node.processes import Proc, running


@contextlib.contextmanager
def forced_replies(upstream: str, model_dir: Path, script: Path, *, record: Path | None = None,
                   log: Path | None = None, timeout: float = 60.0,
                   echo: Callable[[str], None] | None = None) -> Iterator[Proc]:
    """The scripting shim (forced_replies.py) in front of `upstream`, a vLLM started with
    `extra_args=vllm_plugin_args(), env=vllm_plugin_env()`: each chat request gets the script's reply
    as `vllm_xargs.polar_forced` token ids. `record`: one JSON line per forced reply."""

    cmd = [sys.executable, "-m", "harness_recipes.demo.forced_replies", "--upstream", upstream, "--model", str(model_dir),
           "--script", str(script), "--host", "127.0.0.1", "--port", "0"]
    if record is not None:
        cmd += ["--log", str(record)]
    with running(cmd, log=log, ready_line=READY, timeout=timeout, echo=echo, what="forced-replies shim") as p:
        yield p


@contextlib.contextmanager
def scripted_vllm(model_dir: Path, script: Path, *, model_name: str = "polar-model", extra_args=(),
                  env: dict | None = None, record: Path | None = None, vllm_log: Path | None = None,
                  shim_log: Path | None = None, timeout: float = 600.0,
                  echo: Callable[[str], None] | None = None) -> Iterator[Proc]:
    """The real vLLM with the ForcedReply plugin and the scripting shim in front of it: the scripted
    counterpart of `serve(model_dir, script=...)`. Yields the shim's Proc (`.url`: point the capture
    proxy at it); `.vllm` is vLLM's Proc."""

    with vllm(model_dir, model_name=model_name, extra_args=[*vllm_plugin_args(), *map(str, extra_args)],
              env={**vllm_plugin_env(), **(env or {})}, log=vllm_log, timeout=timeout, echo=echo) as v, \
            forced_replies(v.url, model_dir, script, record=record, log=shim_log, echo=echo) as shim:
        shim.vllm = v
        yield shim
