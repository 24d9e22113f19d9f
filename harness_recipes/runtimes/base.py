"""The runtime interface and the pieces every runtime shares (workspace preparation, process kill)."""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path

from harness_recipes.execution import ExecResult
from harness_recipes.runtimes.file_tree import ObjectStore, Snapshot, snapshot_dir
from harness_recipes.tasks.task_file import Task

from .api_socket import ApiSocket, inner_base_url, wrap_argv

OUTPUT_CAP = 1 << 20  # keep at most 1 MiB of a command's output in memory
KILL_GRACE = 3.0  # seconds between SIGTERM and SIGKILL


class Sandbox(ABC):
    """One episode's isolated place: a workspace, a home, a way to run commands there."""

    workspace: str  # path as the commands inside see it
    home: str
    root: Path  # the episode directory on the host: config files may be written only below it
    isolation: str = "none"  # none | bubblewrap | docker: recorded with every episode
    # The model API's way in (api_socket.py) and the sandbox's python3 that runs the inner forwarder;
    # None: the harness shares the host's network (isolation none) or has no way out at all.
    api: ApiSocket | None = None
    python: str = "python3"
    # SWE-bench instance images: their name, and "official" (an official image: its conda env) or
    # "built" (built here: Polar's venv); it picks the eval script's activation (eval_script.py).
    image: str = ""
    image_path: str = ""
    # The host uid/gid the agent runs as when it is not the node's (a root node's bubblewrap sandbox):
    # files the node writes for it (config files) are handed to it, or the harness could not change them.
    owner: tuple[int, int] | None = None

    def api_base(self, proxy: str) -> str:
        """The proxy's base URL as the harness inside sees it."""
        return inner_base_url(proxy) if self.api is not None else proxy

    def harness_argv(self, argv: list[str], callers: tuple[str, ...] = ()) -> list[str]:
        """The harness command, behind the inner forwarder when the API comes through a socket; ``callers``:
        the recipe's model_callers (inner_forwarder.py: only the harness, and those, talk to the model)."""
        return wrap_argv(self.python, argv, callers) if self.api is not None else argv

    async def close_api(self) -> None:
        if self.api is not None:
            await self.api.close()

    async def write_file(self, path: str, content: str) -> None:
        await self.write_bytes(path, content.encode())

    async def write_bytes(self, path: str, content: bytes) -> None:
        p = Path(path)
        if not p.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"refusing to write {path} outside the episode directory {self.root}")
        new_dirs = [d for d in (p.parent, *p.parent.parents) if not d.exists()]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content)
        if self.owner is not None:
            for q in (p, *new_dirs):
                os.lchown(q, *self.owner)

    @abstractmethod
    async def exec(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> ExecResult: ...

    @abstractmethod
    async def close(self) -> None:
        """Stop everything still running in the sandbox and delete it; safe to call twice."""

    async def snapshot(self, store: ObjectStore) -> Snapshot:
        """The workspace's file tree, read by the node into ``store`` (file_tree.py): nothing runs in the
        sandbox, nothing of its git is asked."""
        return await asyncio.to_thread(snapshot_dir, Path(self.workspace), store)


class Runtime(ABC):
    name: str
    grading: str  # how prepare_grading isolates grading: "fresh-container" | "fresh-workspace"

    isolation: str = "none"

    @abstractmethod
    async def prepare(self, task: Task, episode_id: str, harness_prefix: Path, upstream: str | None = None) -> Sandbox:
        """A sandbox for one episode; ``upstream``: the episode's proxy (its base URL), the one thing
        the sandbox may reach. None: no way out at all."""

    async def prepare_grading(self, task: Task, episode_id: str, harness_prefix: Path) -> Sandbox:
        """A fresh sandbox with the pristine workspace, for grading: nothing of the agent's is in it."""
        return await self.prepare(task, episode_id, harness_prefix)

    async def shutdown(self) -> None:  # noqa: B027  (optional: most runtimes share nothing)
        """Release anything shared by the runtime's sandboxes."""


def _git(args: list[str], cwd: Path) -> None:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_AUTHOR_NAME": "polar", "GIT_AUTHOR_EMAIL": "polar@localhost",
           "GIT_COMMITTER_NAME": "polar", "GIT_COMMITTER_EMAIL": "polar@localhost"}
    proc = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()[-500:]}")


def populate_workspace(task: Task, dest: Path) -> None:
    """Copy or check out the task's workspace into dest and commit it, so changes show in git status."""
    if task.git_repo is not None:
        # --local --no-hardlinks: a private copy, nothing fetched over the network.
        _git(["clone", "-q", "--no-hardlinks", str(task.git_repo), str(dest)], dest.parent)
        _git(["checkout", "-q", task.git_commit], dest)
    else:
        if task.workspace_dir is not None:
            shutil.copytree(task.workspace_dir, dest, symlinks=True)
        else:
            dest.mkdir(parents=True)
        if not (dest / ".git").exists():
            _git(["init", "-q"], dest)
            _git(["add", "-A"], dest)
            _git(["commit", "-q", "--allow-empty", "-m", "task workspace"], dest)
    if task.setup_patch:
        (dest / ".polar-setup.patch").write_text(task.setup_patch)
        _git(["apply", ".polar-setup.patch"], dest)
        (dest / ".polar-setup.patch").unlink()
        _git(["add", "-A"], dest)
        _git(["commit", "-q", "-m", "setup patch"], dest)


def kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> bytes:
    buf = bytearray()
    while chunk := await stream.read(65536):
        if len(buf) < cap:
            buf += chunk[: cap - len(buf)]
    return bytes(buf)


# A limit check while a command runs: '' while within limits, else the reason to stop it.
Watch = Callable[[], Awaitable[str]]


async def run_process(argv: list[str], env: dict[str, str], timeout: float, cwd: str | None,
                      watch: Watch | None = None, poll: float = 0.5, **spawn) -> ExecResult:
    """Run argv in its own process group; on timeout or cancel, kill the whole group (TERM, then KILL).
    ``watch``, when given, is asked every ``poll`` seconds: a reason ends the command at once (KILL)
    and comes back as ExecResult.limit. ``spawn``: more of create_subprocess_exec's arguments
    (preexec_fn, pass_fds)."""
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, **spawn,
    )
    readers = asyncio.gather(_read_capped(proc.stdout, OUTPUT_CAP), _read_capped(proc.stderr, OUTPUT_CAP))
    timed_out = False
    limit = ""
    try:
        if watch is None:
            await asyncio.wait_for(proc.wait(), timeout)
        else:
            limit = await _wait_watched(proc, timeout, watch, poll)
            if limit:
                kill_group(proc.pid, signal.SIGKILL)  # a bomb gets no grace period
                await proc.wait()
    except TimeoutError:
        timed_out = True
    except BaseException:  # cancelled (Ctrl-C): kill, then let the cancel go on
        try:
            await _terminate(proc)
        finally:  # even if a second cancel cuts the grace period short
            kill_group(proc.pid, signal.SIGKILL)
            readers.cancel()
        raise
    if timed_out:
        await _terminate(proc)
    # The group may outlive its leader (a background child): make sure nothing of it survives.
    kill_group(proc.pid, signal.SIGKILL)
    out, err = await readers
    if watch is not None and not limit and not timed_out:
        limit = await watch()  # a limit reached just before the end (an OOM kill that ended the command)
    rc = None if timed_out or limit else proc.returncode
    return ExecResult(rc=rc, stdout=out, stderr=err, timed_out=timed_out, seconds=time.monotonic() - t0, limit=limit)


async def _wait_watched(proc: asyncio.subprocess.Process, timeout: float, watch: Watch, poll: float) -> str:
    """Wait for proc like wait_for(proc.wait(), timeout), asking watch every poll seconds; its reason, or ''."""
    deadline = time.monotonic() + timeout
    waiter = asyncio.ensure_future(proc.wait())
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait({waiter}, timeout=min(poll, left))
            if done:
                return ""
            reason = await watch()
            if reason:
                return reason
    finally:
        waiter.cancel()


async def _terminate(proc: asyncio.subprocess.Process) -> None:
    kill_group(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_GRACE)
    except TimeoutError:
        kill_group(proc.pid, signal.SIGKILL)
        await proc.wait()
