"""The local runtime: a temporary directory per episode, bubblewrap isolation when available.

Under bubblewrap the whole host is read-only except the episode's own directory (workspace +
home) and a private /tmp; the harness gets its own pid namespace and dies with its parent, so a
timeout or Ctrl-C leaves nothing running. The network is shared (the harness must reach the proxy
on loopback). Without bubblewrap it runs as a plain process group in the temporary directory.
"""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from importlib.resources import files
from pathlib import Path

from harness_recipes.cache import harness_cache
from harness_recipes.tasks.task_file import Task

from .base import ExecResult, Runtime, Sandbox, populate_workspace, run_process


def _visible_under_tmp() -> list[str]:
    """Paths the harness needs that a private /tmp would hide, when they live under /tmp: the harness
    CLIs (the harness cache), the Python environment, and where Polar's packages are imported from
    (a checkout, for an editable install)."""
    packages = {Path(str(files(p))).resolve().parent for p in ("harness_recipes", "polar_data")}
    keep = {*packages, Path(sys.prefix).resolve(), harness_cache().resolve()}
    tmp = Path("/tmp").resolve()
    return sorted(str(p) for p in keep if p.is_relative_to(tmp) and p != tmp and p.exists())


def bwrap_available() -> bool:
    exe = shutil.which("bwrap")
    if not exe:
        return False
    # Present is not enough: user namespaces may be off in this container.
    probe = subprocess.run([exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-pid",
                            "--die-with-parent", "true"], capture_output=True)
    return probe.returncode == 0


class LocalSandbox(Sandbox):
    def __init__(self, root: Path, isolate: bool):
        self.root = root
        self.workspace = str(root / "workspace")
        self.home = str(root / "home")
        self.isolate = isolate
        self._closed = False

    def _wrap(self, argv: list[str], cwd: str) -> list[str]:
        if not self.isolate:
            return argv
        root = str(self.root)
        keep = [a for p in _visible_under_tmp() for a in ("--ro-bind", p, p)]
        return ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *keep,
                "--bind", root, root, "--unshare-pid", "--die-with-parent", "--chdir", cwd, "--", *argv]

    async def exec(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> ExecResult:
        if self._closed:
            raise RuntimeError("sandbox already closed")
        cwd = cwd or self.workspace
        return await run_process(self._wrap(argv, cwd), env, timeout, cwd)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await asyncio.to_thread(shutil.rmtree, self.root, True)


class LocalRuntime(Runtime):
    name = "local"
    # A fresh temporary directory with the task's workspace populated again by the node. Under
    # bubblewrap the agent's processes died with its sandbox; without it (isolation none) a process
    # that left its process group may still run: only bubblewrap makes local grading tamper-proof.
    grading = "fresh-workspace"

    def __init__(self, isolation: str = "auto", workdir: str | None = None, keep: bool = False):
        if isolation not in ("auto", "bwrap", "none"):
            raise ValueError(f"isolation must be auto, bwrap or none, not {isolation!r}")
        have = bwrap_available()
        if isolation == "bwrap" and not have:
            raise RuntimeError("isolation=bwrap asked for, but bubblewrap is missing or cannot create namespaces "
                               "(apt-get install -y bubblewrap)")
        self.isolate = have and isolation != "none"
        self.workdir = workdir
        self.keep = keep

    async def prepare(self, task: Task, episode_id: str, harness_prefix: Path) -> Sandbox:
        if task.swebench is not None:
            raise RuntimeError(f"{task.id}: SWE-bench instances run on the docker runtime (--runtime docker): their "
                               "eval script and graded tests run in the instance's image, in /testbed")
        root = Path(tempfile.mkdtemp(prefix=f"polar-{episode_id}-", dir=self.workdir))
        sandbox = LocalSandbox(root, self.isolate)
        try:
            (root / "home").mkdir()
            await asyncio.to_thread(populate_workspace, task, root / "workspace")
        except BaseException:
            await sandbox.close()
            raise
        if self.keep:
            sandbox.close = _noop  # type: ignore[method-assign]  # --keep-workspaces: leave for inspection
        return sandbox


async def _noop() -> None:
    return None
