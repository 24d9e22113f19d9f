"""Start polar-serve for tests: the cached tiny model and a context manager around the server.

    from tests.support.servers import tiny_model_dir, polar_serve
    with polar_serve(tiny_model_dir(), "vllm", script="data/scripts/create_hello.json") as srv:
        httpx.post(srv.base_url + "/v1/chat/completions", json=...)

The server is a real subprocess (`python -m polar_serve.cli`, harness_recipes.node.local_stack.serve), bound to
127.0.0.1 on a free port (`--port 0`; the port is read from its `polar-serve listening on ...` line)
and stopped by pid when the block exits. The tiny model lives in Polar's cache (harness_recipes/cache.py),
which tests/conftest.py points at the checkout's .cache/ unless POLAR_CACHE says otherwise.
"""
from __future__ import annotations

from pathlib import Path

from harness_recipes.cache import TINY_SEED, tiny_model
from harness_recipes.node.local_stack import serve

REPO = Path(__file__).resolve().parents[2]


def tiny_model_dir(seed: int = TINY_SEED) -> Path:
    """Build the tiny random Qwen3 once (under a file lock, for parallel test processes); return its dir."""
    return tiny_model(seed)


def polar_serve(model_dir, dialect: str = "vllm", script=None, extra_args=(), timeout: float = 120.0):
    """Run polar-serve as a subprocess for the duration of the block; yield its Proc (`.base_url`, `.port`)."""
    return serve(model_dir, script, dialect, model_name=None, extra_args=extra_args, timeout=timeout)
