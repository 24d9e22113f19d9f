"""The local runtime: a temporary directory per episode, run under bubblewrap.

Under bubblewrap the harness sees a root built from nothing: read-only the system (/usr, the
usr-merge links, /etc less its secrets), the harness CLI (its recipe's own install prefix) and the Python
environment its interpreter lives in (a venv and the Python it was made from); read-write only its
workspace and home; a private /tmp, /proc and /dev. Not the checkout, not LOGDIR or OUT, not the
rest of $POLAR_CACHE, not /root, not other episodes. It has its own network namespace (only `lo`),
pid, ipc and uts namespaces, no capabilities, and dies with its parent. The model API comes in
through a per-episode Unix socket (api_socket.py), the only way out.

No silent fallback: without a working bubblewrap the runtime refuses to start (isolation auto or
bwrap). Only an explicit isolation none runs the harness as a plain process group on the host's
network, with a warning, and every episode it runs is marked isolation=none.
"""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness_recipes.cache import install_prefix
from harness_recipes.tasks.task_file import Task

from .api_socket import SANDBOX_DIR, ApiSocket
from .base import ExecResult, Runtime, Sandbox, populate_workspace, run_process

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# /etc is read-only but these are hidden: password hashes, host keys, sudo rules, private TLS keys.
ETC_HIDDEN = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/etc/sudoers",
              "/etc/sudoers.d", "/etc/ssl/private", "/etc/machine-id", "/etc/docker")
NAMESPACES = ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts")
HOW_TO_GET = ("install bubblewrap (apt-get install -y bubblewrap) where user namespaces are allowed, or use "
              "--runtime docker; --isolation none runs the harness unsandboxed on the host's network "
              "(every episode is then marked isolation=none)")


def _system_args() -> list[str]:
    args: list[str] = []
    for p in SYSTEM:
        path = Path(p)
        if path.is_symlink():
            args += ["--symlink", str(path.readlink()), p]  # the usr-merge links
        elif path.is_dir():
            args += ["--ro-bind", p, p]
    args += ["--ro-bind", "/etc", "/etc"]
    for p in ETC_HIDDEN:
        path = Path(p)
        if path.is_dir() and not path.is_symlink():
            args += ["--tmpfs", p]
        elif path.exists():
            args += ["--ro-bind", "/dev/null", p]
    return args


def _under_system(p: Path) -> bool:
    return any(p.is_relative_to(s) for s in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64"))


def interpreter_dirs(exe: Path) -> set[Path]:
    """Directories the harness's executable needs outside the system dirs: the directories along its
    symlink chain, the interpreter named by its #! line (recursively), a venv (pyvenv.cfg) and the
    Python prefix a venv's python links to. The recipe's install prefix is bound by LocalRuntime.binds."""
    out: set[Path] = set()
    seen: set[Path] = set()
    todo = [Path(exe)]
    while todo:
        p = todo.pop()
        if p in seen or not p.exists():
            continue
        seen.add(p)
        for parent in (p.parent, p.parent.parent):
            if (parent / "pyvenv.cfg").exists():
                out.add(parent)
        if p.is_symlink():
            target = p.parent / p.readlink()
            todo.append(target)
            continue
        real = p.resolve()
        if real.name.startswith("python"):  # a real interpreter: its prefix holds the stdlib
            out.add(real.parent.parent)
        try:
            with open(real, "rb") as f:
                head = f.read(256)
        except OSError:
            continue
        if head.startswith(b"#!"):
            words = head[2:].split(b"\n", 1)[0].decode(errors="replace").split()
            if words and words[0] != "/usr/bin/env":
                todo.append(Path(words[0]))
    return {d for d in out if not _under_system(d)}


def bwrap_problem() -> str:
    """'' when bubblewrap can make the sandbox we need here, else what is wrong."""
    exe = shutil.which("bwrap")
    if not exe:
        return "bubblewrap (bwrap) is not installed"
    # Present is not enough: user or network namespaces may be off in this container.
    probe = subprocess.run([exe, *_system_args(), "--proc", "/proc", "--dev", "/dev", *NAMESPACES,
                            "--cap-drop", "ALL", "--die-with-parent", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"bubblewrap cannot create its namespaces here: {probe.stderr.strip()[-300:]}"
    return ""


def bwrap_available() -> bool:
    return not bwrap_problem()


def sandbox_python() -> str:
    """The python3 that runs the inner forwarder under bubblewrap (the system's, else ours: both bound)."""
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    return found or str(Path(sys.base_prefix) / "bin" / "python3")


class LocalSandbox(Sandbox):
    def __init__(self, root: Path, isolate: bool, binds: list[str] | None = None):
        self.root = root
        self.workspace = str(root / "workspace")
        self.home = str(root / "home")
        self.isolate = isolate
        self.isolation = "bubblewrap" if isolate else "none"
        self.binds = binds or []  # read-only, beyond the system: harness cache, interpreters
        self.python = sandbox_python()
        self._closed = False

    def bwrap_argv(self, argv: list[str], cwd: str) -> list[str]:
        ro = [a for p in self.binds for a in ("--ro-bind", p, p)]
        api = ["--ro-bind", str(self.api.dir), SANDBOX_DIR] if self.api is not None else []
        return ["bwrap", *_system_args(), "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--dir", "/run",
                *ro, "--bind", self.workspace, self.workspace, "--bind", self.home, self.home, *api,
                *NAMESPACES, "--hostname", "sandbox", "--cap-drop", "ALL", "--new-session", "--die-with-parent",
                "--chdir", cwd, "--", *argv]

    async def exec(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> ExecResult:
        if self._closed:
            raise RuntimeError("sandbox already closed")
        cwd = cwd or self.workspace
        return await run_process(self.bwrap_argv(argv, cwd) if self.isolate else argv, env, timeout, cwd)

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.close_api()
            await asyncio.to_thread(shutil.rmtree, self.root, True)


class LocalRuntime(Runtime):
    name = "local"
    # A fresh temporary directory with the task's workspace populated again by the node. Under
    # bubblewrap the agent's processes died with its sandbox; without it (isolation none) a process
    # that left its process group may still run: only bubblewrap makes local grading tamper-proof.
    grading = "fresh-workspace"

    def __init__(self, isolation: str = "auto", workdir: str | None = None, keep: bool = False,
                 extra_ro: tuple[str, ...] = ()):
        if isolation not in ("auto", "bwrap", "none"):
            raise ValueError(f"isolation must be auto, bwrap or none, not {isolation!r}")
        if isolation == "none":
            print("polar-rollout: WARNING: --isolation none: the harness runs UNSANDBOXED on this host, with its "
                  "network, files and credentials; every episode is marked isolation=none", file=sys.stderr)
        else:
            problem = bwrap_problem()
            if problem:
                raise RuntimeError(f"no isolation for the local runtime: {problem}. To get it: {HOW_TO_GET}")
        self.isolate = isolation != "none"
        self.isolation = "bubblewrap" if self.isolate else "none"
        self.workdir = workdir
        self.keep = keep
        self.extra_ro = tuple(str(Path(p).resolve()) for p in extra_ro)  # e.g. a harness script outside the cache
        self._binds: dict[Path, list[str]] = {}

    def binds(self, exe: Path) -> list[str]:
        """What the sandbox sees read-only beyond the system: the harness's own install prefix
        (never the whole harness cache: other harnesses and caches are not the agent's business),
        its interpreters, and extra_ro."""
        if exe not in self._binds:
            keep = {*interpreter_dirs(exe), *(Path(p) for p in self.extra_ro)}
            prefix = install_prefix(exe)
            if prefix is not None:
                keep.add(prefix)
            self._binds[exe] = sorted(str(p) for p in keep if p.exists())
        return self._binds[exe]

    async def prepare(self, task: Task, episode_id: str, harness_prefix: Path, upstream: str | None = None) -> Sandbox:
        if task.swebench is not None:
            raise RuntimeError(f"{task.id}: SWE-bench instances run on the docker runtime (--runtime docker): their "
                               "eval script and graded tests run in the instance's image, in /testbed")
        root = Path(tempfile.mkdtemp(prefix=f"polar-{episode_id}-", dir=self.workdir))
        sandbox = LocalSandbox(root, self.isolate, self.binds(Path(harness_prefix)) if self.isolate else None)
        try:
            (root / "home").mkdir()
            await asyncio.to_thread(populate_workspace, task, root / "workspace")
            if self.isolate and upstream is not None:
                sandbox.api = await ApiSocket(upstream).start()
        except BaseException:
            await sandbox.close()
            raise
        if self.keep:
            sandbox.close = _close_api_only(sandbox)  # type: ignore[method-assign]  # --keep-workspaces
        return sandbox


def _close_api_only(sandbox: Sandbox):
    async def close() -> None:
        await sandbox.close_api()
    return close
