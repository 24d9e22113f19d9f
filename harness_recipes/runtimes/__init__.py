"""Runtimes: where one episode's workspace lives and where the harness and the evaluation run."""
from __future__ import annotations

from .base import ExecResult, Runtime, Sandbox


def make_runtime(name: str, **options) -> Runtime:
    # imported on choice: the docker runtime needs the docker SDK, the local one bubblewrap
    if name == "local":
        from .local import LocalRuntime
        return LocalRuntime(**options)
    if name == "docker":
        from .docker import DockerRuntime
        return DockerRuntime(**options)
    raise ValueError(f"unknown runtime {name!r} (choose local or docker)")


__all__ = ["ExecResult", "Runtime", "Sandbox", "make_runtime"]
