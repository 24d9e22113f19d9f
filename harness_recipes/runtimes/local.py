"""The local runtime: a temporary directory per episode, run under bubblewrap.

Under bubblewrap the harness sees a root built from nothing: read-only the system (/usr, the
usr-merge links, /etc less its secrets), the harness CLI (its recipe's own install prefix) and the Python
environment its interpreter lives in (a venv and the Python it was made from); read-write only its
workspace and home; a private /tmp, /proc and /dev. Not the checkout, not LOGDIR or OUT, not the
rest of $POLAR_CACHE, not /root, not other episodes. It has its own network namespace (only `lo`),
pid, ipc and uts namespaces, no capabilities, and dies with its parent. The model API comes in
through a per-episode Unix socket (api_socket.py), the only way out.

Not root on the host. A node running as root: bubblewrap builds the sandbox as root (so it can bind
whatever the node can read), then setpriv drops the harness to SANDBOX_UID (nobody) with no
capabilities and no way back (no_new_privs); that uid owns the episode's workspace and home. (A
bubblewrap user namespace would not do here: bubblewrap maps the sandbox's uid to its caller's, so the
agent would still be uid 0 on the host.) A node not running as root: a user namespace
(--unshare-user) maps the agent, uid/gid 1000 inside, to the node's own unprivileged uid. A seccomp
filter (seccomp_filter.py) refuses the keyring, ptrace, new namespaces, mounts, eBPF and the like;
/proc/keys and /proc/key-users are hidden (/dev/null over them: unreadable, as the hidden /etc files).

Limits (recipes/limits.py): each episode runs in a cgroup of its own (cgroups.py: memory, process count, CPU
share), joined before bubblewrap starts; /tmp is a tmpfs of at most the disk limit; the workspace
and home are measured by a watchdog every disk_poll seconds, no single file may outgrow the disk
limit (RLIMIT_FSIZE). A command that reaches a limit is killed at once and its ExecResult says which.

No silent fallback: without a working bubblewrap the runtime refuses to start (isolation auto or
bwrap). Only an explicit isolation none runs the harness as a plain process group on the host's
network, with a warning, and every episode it runs is marked isolation=none; it has no limits either.
"""
from __future__ import annotations

import asyncio
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

from harness_recipes.cache import install_prefix
from harness_recipes.recipes.limits import Limits
from harness_recipes.tasks.task_file import Task

from .api_socket import SANDBOX_DIR, ApiSocket
from .base import ExecResult, Runtime, Sandbox, populate_workspace, run_process
from .cgroups import CgroupError, CgroupTree, EpisodeCgroup
from .limits import disk_reason, disk_usage
from .seccomp_filter import SeccompError, seccomp_fd

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# /etc is read-only but these are hidden: password hashes, host keys, sudo rules, private TLS keys.
ETC_HIDDEN = ("/etc/shadow", "/etc/shadow-", "/etc/gshadow", "/etc/gshadow-", "/etc/ssh", "/etc/sudoers",
              "/etc/sudoers.d", "/etc/ssl/private", "/etc/machine-id", "/etc/docker")
NAMESPACES = ("--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts")
SANDBOX_UID = SANDBOX_GID = 65534  # nobody / nogroup: the agent's uid on the host, for a root node
# A root node: the sandbox keeps only the capabilities setpriv needs to drop to SANDBOX_UID, then none.
AS_ROOT = ("--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID")
DROP = ("setpriv", "--reuid", str(SANDBOX_UID), "--regid", str(SANDBOX_GID), "--clear-groups", "--inh-caps=-all",
        "--bounding-set=-all", "--no-new-privs", "--")
# A node not running as root: its own uid, as uid 1000 of a user namespace.
AS_USER = ("--unshare-user", "--uid", "1000", "--gid", "1000", "--cap-drop", "ALL")


@cache
def bwrap_supports(option: str) -> bool:
    """Whether this bubblewrap knows ``option`` (--size and --disable-userns came with 0.7 and 0.8;
    without them /tmp is bounded by the memory limit only, and new user namespaces by seccomp only)."""
    exe = shutil.which("bwrap")
    if not exe:
        return False
    out = subprocess.run([exe, "--help"], capture_output=True, text=True)
    return option in out.stdout + out.stderr
# The kernel keyring's listing: host users' key descriptions (and ids to ask keyctl for) otherwise.
PROC_HIDDEN = ("/proc/keys", "/proc/key-users")
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


def _open_parents(binds: list[str]) -> list[str]:
    """The directories above each bind, made 0755 first: bubblewrap would make them 0700 (closed to
    the agent's unprivileged uid). Not those under the system directories: they are bound as they are."""
    dirs = {a for b in binds for a in Path(b).parents if a != Path("/") and not _under_system(a)}
    return [x for d in sorted(dirs, key=lambda d: len(d.parts)) for x in ("--perms", "0755", "--dir", str(d))]


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


def sandbox_owner() -> tuple[int, int] | None:
    """The agent's host uid/gid: SANDBOX_UID for a root node, None (the node's own, already
    unprivileged) otherwise."""
    return (SANDBOX_UID, SANDBOX_GID) if os.geteuid() == 0 else None


def identity_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(bubblewrap's identity options, the command) so that the agent is not root on the host."""
    if sandbox_owner() is not None:
        return list(AS_ROOT), [*DROP, *argv]
    return [*AS_USER, *(["--disable-userns"] if bwrap_supports("--disable-userns") else [])], argv


def bwrap_problem() -> str:
    """'' when bubblewrap can make the sandbox we need here, else what is wrong."""
    exe = shutil.which("bwrap")
    if not exe:
        return "bubblewrap (bwrap) is not installed"
    try:
        fd = seccomp_fd()
    except SeccompError as e:
        return str(e)
    # Present is not enough: user or network namespaces may be off in this container.
    ident, argv = identity_args(["true"])
    try:
        probe = subprocess.run([exe, *_system_args(), "--proc", "/proc", "--dev", "/dev", *NAMESPACES, *ident,
                                "--seccomp", str(fd), "--die-with-parent", "--", *argv],
                               capture_output=True, text=True, pass_fds=(fd,))
    finally:
        os.close(fd)
    if probe.returncode != 0:
        return f"bubblewrap cannot create its sandbox here: {probe.stderr.strip()[-300:]}"
    return ""


def bwrap_available() -> bool:
    return not bwrap_problem()


def sandbox_python() -> str:
    """The python3 that runs the inner forwarder under bubblewrap (the system's, else ours: both bound)."""
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    return found or str(Path(sys.base_prefix) / "bin" / "python3")


class LocalSandbox(Sandbox):
    def __init__(self, root: Path, isolate: bool, binds: list[str] | None = None, limits: Limits | None = None,
                 cgroup: EpisodeCgroup | None = None):
        self.root = root
        self.workspace = str(root / "workspace")
        self.home = str(root / "home")
        self.isolate = isolate
        self.isolation = "bubblewrap" if isolate else "none"
        self.binds = binds or []  # read-only, beyond the system: harness cache, interpreters
        self.python = sandbox_python()
        self.limits = limits if isolate and limits is not None else Limits(memory=0, pids=0, cpus=0, disk=0)
        self.cgroup = cgroup
        self.owner = sandbox_owner() if isolate else None
        self._disk_checked = 0.0
        self._closed = False

    def bwrap_argv(self, argv: list[str], cwd: str, seccomp: int | None = None) -> list[str]:
        ro = [a for p in self.binds for a in ("--ro-bind", p, p)]
        api = ["--ro-bind", str(self.api.dir), SANDBOX_DIR] if self.api is not None else []
        hidden = [a for p in PROC_HIDDEN if Path(p).exists() for a in ("--ro-bind", "/dev/null", p)]
        tmp = ["--size", str(self.limits.disk)] if self.limits.disk and bwrap_supports("--size") else []
        filt = ["--seccomp", str(seccomp)] if seccomp is not None else []
        ident, argv = identity_args(argv)
        binds = [*self.binds, self.workspace, self.home]
        return ["bwrap", *_system_args(), "--proc", "/proc", *hidden, "--dev", "/dev", *tmp, "--perms", "1777",
                "--tmpfs", "/tmp", "--dir", "/run", *_open_parents(binds), *ro,
                "--bind", self.workspace, self.workspace, "--bind", self.home, self.home, *api,
                *NAMESPACES, *ident, "--hostname", "sandbox", "--new-session", "--die-with-parent", *filt,
                "--chdir", cwd, "--", *argv]

    def _preexec(self):
        """Runs in the child between fork and exec: into the episode's cgroup, the per-file size limit.
        Nothing of the sandbox exists yet."""
        procs = self.cgroup.procs if self.cgroup is not None else []
        disk = self.limits.disk

        def preexec() -> None:
            # bubblewrap makes the directories above each bind with the umask: a node's strict umask
            # (077) would make them closed to the agent's unprivileged uid.
            os.umask(0o022)
            for path in procs:
                with open(path, "w") as f:
                    f.write(str(os.getpid()))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if disk:
                resource.setrlimit(resource.RLIMIT_FSIZE, (disk, disk))
        return preexec

    async def watch(self) -> str:
        """'' while the episode is within its limits, else which one it reached."""
        if self.cgroup is not None and (reason := self.cgroup.hit()):
            return reason
        if self.limits.disk and time.monotonic() - self._disk_checked >= self.limits.disk_poll:
            self._disk_checked = time.monotonic()
            used = await asyncio.to_thread(disk_usage, [Path(self.workspace), Path(self.home)], self.limits.disk)
            if used > self.limits.disk:
                return disk_reason(used, self.limits.disk, "the workspace and home")
        return ""

    async def exec(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> ExecResult:
        if self._closed:
            raise RuntimeError("sandbox already closed")
        cwd = cwd or self.workspace
        if not self.isolate:
            return await run_process(argv, env, timeout, cwd)
        fd = seccomp_fd()
        try:
            self._disk_checked = 0.0
            if self.cgroup is not None:
                self.cgroup.mark()
            res = await run_process(self.bwrap_argv(argv, cwd, fd), env, timeout, cwd, watch=self.watch,
                                    poll=min(0.5, self.limits.disk_poll), preexec_fn=self._preexec(), pass_fds=(fd,))
        finally:
            os.close(fd)
        if res.limit and self.cgroup is not None:
            await asyncio.to_thread(self.cgroup.kill)  # whatever of the bomb outlived bubblewrap
        return res

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self.close_api()
            if self.cgroup is not None:
                await asyncio.to_thread(self.cgroup.remove)
            await asyncio.to_thread(shutil.rmtree, self.root, True)


class LocalRuntime(Runtime):
    name = "local"
    # A fresh temporary directory with the task's workspace populated again by the node. Under
    # bubblewrap the agent's processes died with its sandbox; without it (isolation none) a process
    # that left its process group may still run: only bubblewrap makes local grading tamper-proof.
    grading = "fresh-workspace"

    def __init__(self, isolation: str = "auto", workdir: str | None = None, keep: bool = False,
                 extra_ro: tuple[str, ...] = (), limits: Limits | None = None):
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
        self.limits = limits or Limits()
        self.cgroups: CgroupTree | None = None
        if self.isolate and (self.limits.memory or self.limits.pids or self.limits.cpus):
            try:
                self.cgroups = CgroupTree(self.limits)
            except CgroupError as e:
                raise RuntimeError(f"no resource limits for the bubblewrap sandbox ({self.limits.describe()}): {e}. "
                                   "To run without them, set --memory 0 --pids 0 --cpus 0") from None
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

    async def shutdown(self) -> None:
        if self.cgroups is not None:
            await asyncio.to_thread(self.cgroups.remove)

    async def prepare(self, task: Task, episode_id: str, harness_prefix: Path, upstream: str | None = None) -> Sandbox:
        if task.swebench is not None:
            raise RuntimeError(f"{task.id}: SWE-bench instances run on the docker runtime (--runtime docker): their "
                               "eval script and graded tests run in the instance's image, in /testbed")
        root = Path(tempfile.mkdtemp(prefix=f"polar-{episode_id}-", dir=self.workdir))
        sandbox = LocalSandbox(root, self.isolate, self.binds(Path(harness_prefix)) if self.isolate else None,
                               self.limits)
        try:
            if self.cgroups is not None:  # named as its directory: unique, even for a grading sandbox
                sandbox.cgroup = await asyncio.to_thread(self.cgroups.episode, root.name)
            (root / "home").mkdir()
            await asyncio.to_thread(populate_workspace, task, root / "workspace")
            if self.isolate and upstream is not None:
                sandbox.api = await ApiSocket(upstream).start()
            if sandbox.owner is not None:
                await asyncio.to_thread(_hand_over, sandbox)
        except BaseException:
            await sandbox.close()
            raise
        if self.keep:
            sandbox.close = _close_api_only(sandbox)  # type: ignore[method-assign]  # --keep-workspaces
        return sandbox


def _hand_over(sandbox: LocalSandbox) -> None:
    """The episode's own files to the sandbox's uid: its workspace and home (to write), its API
    socket's directory and socket (to connect). The episode directory itself stays the node's."""
    uid, gid = sandbox.owner
    tops = [Path(sandbox.workspace), Path(sandbox.home)]
    if sandbox.api is not None:
        tops += [sandbox.api.dir, sandbox.api.path]
    for top in tops:
        os.lchown(top, uid, gid)
        if top.is_dir() and not top.is_symlink() and top in tops[:2]:
            for dirpath, dirnames, filenames in os.walk(top):
                for name in dirnames + filenames:
                    os.lchown(os.path.join(dirpath, name), uid, gid)


def _close_api_only(sandbox: LocalSandbox):
    async def close() -> None:
        await sandbox.close_api()
        if sandbox.cgroup is not None:
            await asyncio.to_thread(sandbox.cgroup.remove)
    return close
