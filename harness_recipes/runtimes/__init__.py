"""Runtimes: where one episode's workspace lives and where the harness and the evaluation run."""
from __future__ import annotations

from harness_recipes.recipes.limits import Limits

from .base import ExecResult, Runtime, Sandbox


def make_runtime(name: str, recipe_limits: dict | None = None, **options) -> Runtime:
    """The runtime ``name``; ``limits`` in options: the sandbox limits (recipes/limits.py), a Limits or
    a table of overrides (the command line's) applied over ``recipe_limits`` (the recipe's [limits])
    over the defaults."""
    limits = options.get("limits")
    if not isinstance(limits, Limits):
        options["limits"] = Limits().merged(recipe_limits or {}).merged(limits or {})
    # imported on choice: the docker runtime needs the docker SDK, the local one bubblewrap
    if name == "local":
        from .local import LocalRuntime
        return LocalRuntime(**options)
    if name == "docker":
        from .docker import DockerRuntime
        return DockerRuntime(**options)
    raise ValueError(f"unknown runtime {name!r} (choose local or docker)")


__all__ = ["ExecResult", "Runtime", "Sandbox", "make_runtime"]
