"""Where Polar keeps what it builds or downloads: the harness CLIs and the tiny demo model.

    $POLAR_HARNESS_CACHE              the harness CLIs (one prefix per recipe), if set
    $POLAR_CACHE                      else everything under here, if set
    $XDG_CACHE_HOME/polar             else (~/.cache/polar when XDG_CACHE_HOME is unset)
    $POLAR_VLLM_PYTHON                the real vLLM's Python, else <cache>/vllm-venv/bin/python

An installed wheel has no checkout to put a `.cache/` in, so the default is the user's cache
directory. The Makefile exports POLAR_CACHE=$(CURDIR)/.cache, so `make harnesses`, `make test` and
`make demo` in a checkout keep everything in its `.cache/` (the test suite sets the same default).
"""
from __future__ import annotations

import os
from pathlib import Path

from polar_serve.tiny import ensure_tiny

TINY_SEED = 0


def polar_cache(*parts: str) -> Path:
    """A path in Polar's cache directory (not created)."""
    base = os.environ.get("POLAR_CACHE")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(xdg) / "polar")
    return Path(base).joinpath(*parts)


def harness_cache() -> Path:
    """The directory of the harness CLI installs: <this>/<recipe name>/."""
    return Path(os.environ.get("POLAR_HARNESS_CACHE") or polar_cache("harnesses"))


def install_prefix(exe: str | os.PathLike) -> Path | None:
    """The recipe's own install prefix, <harness cache>/<name>/ (recipes/install.py), that holds
    ``exe`` (as given or resolved); None for an executable outside the harness cache."""
    cache = harness_cache()
    for root in {cache.absolute(), cache.resolve()}:
        for p in (Path(os.path.abspath(exe)), Path(exe).resolve()):
            if p.is_relative_to(root) and p != root:
                return root / p.relative_to(root).parts[0]
    return None


def vllm_python() -> Path:
    """The Python of the real vLLM's own environment (`make vllm` builds it: vLLM's pins conflict with
    mitmproxy's, so it cannot share ours): $POLAR_VLLM_PYTHON, else <cache>/vllm-venv/bin/python."""
    return Path(os.environ.get("POLAR_VLLM_PYTHON") or polar_cache("vllm-venv", "bin", "python"))


def tiny_model(seed: int = TINY_SEED) -> Path:
    """The tiny random Qwen3 (real tokenizer and chat template), built into the cache once (under a
    file lock: parallel test processes and the demo share it); returns its directory."""

    return ensure_tiny(polar_cache("tiny-qwen3" if seed == TINY_SEED else f"tiny-qwen3-seed{seed}"), seed=seed)
