"""Real processes for the addon's end-to-end tests: mitmdump with the addon, and the fake backend.
Every process is started and stopped by its pid (never by name) with harness_recipes.node.processes; each
one's output goes to a log file in the test's work directory (named after its port)."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from harness_recipes.node.local_stack import addon_script
from harness_recipes.node.local_stack import mitmdump as _mitmdump
from harness_recipes.node.processes import Proc, free_port, running

__all__ = ["Proc", "fake_backend", "free_port", "mitmdump"]

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "bench" / "fake_backend.py"


@contextlib.contextmanager
def mitmdump(workdir: Path, logdir: Path, *, upstream: str | None = None, sets: dict | None = None,
             mode: str | None = None, addon: bool = True, quiet: bool = True):
    """mitmdump (+ the addon) as reverse proxy for ``upstream`` (or in ``mode``)."""
    port = free_port()
    with _mitmdump(upstream=upstream, mode=mode, logdir=logdir, addon=addon_script() if addon else None,
                   confdir=workdir / "mitmconf", sets=sets, quiet=quiet, port=port,
                   log=workdir / f"mitmdump-{port}.log", cwd=workdir, timeout=30) as p:
        yield p


@contextlib.contextmanager
def fake_backend(workdir: Path, dialect: str = "vllm", *, chunks: int = 12, gap_ms: float = 0, first_ms: float = 0,
                 tokenizer: str | None = None):
    """bench/fake_backend.py: a backend speaking `dialect`'s shapes, with token ids."""
    port = free_port()
    cmd = [sys.executable, str(FAKE), "--port", str(port), "--dialect", dialect, "--chunks", str(chunks),
           "--gap-ms", str(gap_ms), "--first-ms", str(first_ms)]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    with running(cmd, log=workdir / f"fake-{port}.log", port=port, timeout=30) as p:
        yield p
