"""What grading code needs of a sandbox, without the runtimes: a command's result and a place to run it.

Tasks (SWE-bench grading) and the verdict sit below the runtimes (tests/layout/test_floors.py): they
are handed a sandbox and use only this much of it. Every runtime's Sandbox (runtimes/base.py)
satisfies `Commands`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class ExecResult:
    rc: int | None  # None: killed (timeout or cancel)
    stdout: bytes
    stderr: bytes
    timed_out: bool
    seconds: float
    # '' or which resource limit stopped the command (recipes/limits.py): the episode then ends as resource_limit
    limit: str = ""


class Commands(Protocol):
    """A sandbox as grading sees it: where the tree is, a home outside it, commands and files."""

    workspace: str
    home: str

    async def exec(self, argv: list[str], env: dict[str, str], timeout: float,
                   cwd: str | None = None) -> ExecResult: ...

    async def write_file(self, path: str, content: str) -> None: ...

    async def write_bytes(self, path: str, content: bytes) -> None: ...
