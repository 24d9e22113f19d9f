"""A cgroup per bubblewrap episode, through the cgroup filesystem directly (no systemd needed).

cgroup v2 (one unified tree) when its memory, pids and cpu controllers can be had; else cgroup v1
(one hierarchy per controller, as on hosts and containers still on the legacy or hybrid layout).
The node's own cgroup is the parent, so whatever limits the node itself runs under still bound all
its episodes: ``<node's cgroup>/polar-<node pid>/<episode>``.

cgroup v2 gives controllers to a cgroup's children only when the cgroup holds no processes itself
(the "no internal processes" rule): when the node's cgroup holds only the node, the node moves itself
into a leaf ``polar-node`` beside its episodes; when other processes share it, creation fails saying
so (run the node in a cgroup of its own: systemd-run --scope -p Delegate=yes, or a container).

Writing a pid into a cgroup needs root (or a delegated tree): a node that cannot create them refuses
to start unless every limit is 0 (LocalRuntime).

Tests: v1 enforced for real (tests/rollout/test_sandbox_limits.py); v2 against a fake tree that answers
as the kernel's cgroup v2 doc says (tests/rollout/test_cgroups_v2.py), not on a v2 kernel.
"""
from __future__ import annotations

import atexit
import os
import signal
import time
from pathlib import Path

from harness_recipes.recipes.limits import Limits, human

CGROUP_ROOT = Path("/sys/fs/cgroup")
CFS_PERIOD = 100_000  # microseconds: the CPU share is quota per this period


class CgroupError(RuntimeError):
    """The cgroup filesystem cannot give the episode its limits here; the message says why."""


def _read(p: Path) -> str:
    try:
        return p.read_text()
    except OSError:
        return ""


def _keyed(text: str, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file ("oom_kill 3\\nmax 0")."""
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key and v.strip().isdigit():
            return int(v)
    return 0


def _write(p: Path, value: str) -> None:
    try:
        p.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value!r} to {p}: {e.strerror or e}") from None


def v1_mounts() -> dict[str, Path]:
    """controller -> mount point of each cgroup v1 hierarchy (from /proc/self/mountinfo)."""
    out: dict[str, Path] = {}
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        pre, _, post = line.partition(" - ")
        fields = post.split()
        if len(fields) >= 3 and fields[0] == "cgroup":
            for opt in fields[2].split(","):
                out.setdefault(opt, Path(pre.split()[4]))
    return out


def own_cgroups(pid: int | str = "self") -> dict[str, str]:
    """controller (or '' for v2) -> the path of ``pid``'s cgroup in that hierarchy."""
    out: dict[str, str] = {}
    for line in _read(Path(f"/proc/{pid}/cgroup")).splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c.removeprefix("name=")] = path
    return out


def v2_root() -> Path | None:
    """The unified hierarchy's mount point, when there is one."""
    for line in _read(Path("/proc/self/mountinfo")).splitlines():
        pre, _, post = line.partition(" - ")
        if post.split()[:1] == ["cgroup2"]:
            return Path(pre.split()[4])
    return None


def _wanted(limits: Limits) -> list[str]:
    return [c for c, on in (("memory", limits.memory), ("pids", limits.pids), ("cpu", limits.cpus)) if on]


class CgroupTree:
    """The node's parent cgroup(s) for its episodes: made once per runtime, removed at shutdown."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.wanted = _wanted(limits)
        self.version, self.parents = self._make_parents()
        # A runtime whose shutdown() never ran (a test, a crash) still leaves no empty cgroup behind.
        atexit.register(self.remove)

    def _make_parents(self) -> tuple[int, dict[str, Path]]:
        name = f"polar-{os.getpid()}"
        root2 = v2_root()
        own = own_cgroups()
        if root2 is not None and set(self.wanted) <= set(_read(root2 / "cgroup.controllers").split()):
            return 2, {"": self._v2_parent(root2 / own.get("", "/").lstrip("/"), name)}
        mounts = v1_mounts()
        missing = [c for c in self.wanted if c not in mounts]
        if missing:
            raise CgroupError(f"no cgroup controller {', '.join(missing)} here (neither a cgroup v2 tree offering it "
                              f"nor a v1 hierarchy in /proc/self/mountinfo)")
        parents = {}
        for c in self.wanted:
            p = mounts[c] / own.get(c, "/").lstrip("/") / name
            try:
                p.mkdir(exist_ok=True)
            except OSError as e:
                raise CgroupError(f"cannot create the cgroup {p}: {e.strerror or e} (creating cgroups needs root or a "
                                  "delegated cgroup tree)") from None
            parents[c] = p
        return 1, parents

    def _v2_parent(self, base: Path, name: str) -> Path:
        # The rules below are the kernel's, Documentation/admin-guide/cgroup-v2.rst: "Enabling and
        # Disabling" (only controllers listed in cgroup.controllers can be enabled), "Threads"
        # (cgroup.type; only threaded controllers, not memory, in a threaded subtree) and "No Internal
        # Process Constraint" (a non-root cgroup with processes of its own cannot enable controllers
        # for its children; writing cgroup.subtree_control fails with EBUSY).
        offered = _read(base / "cgroup.controllers").split()
        if missing := [c for c in self.wanted if c not in offered]:
            # Checked first: writing a controller the cgroup is not offered fails too (ENOENT), and that
            # failure is not the internal-process one below.
            raise CgroupError(
                f"the node's cgroup {base} is not given the {', '.join(missing)} controller(s) (its cgroup.controllers: "
                f"{' '.join(offered) or 'none'}): delegate them to it (systemd-run --scope -p Delegate=yes ..., or a "
                f"container), or set that limit to 0")
        kind = _read(base / "cgroup.type").strip()  # absent on the root cgroup, which is always a domain
        if kind and kind != "domain":
            raise CgroupError(f"the node's cgroup {base} is of type {kind!r}, not 'domain': its children cannot get "
                              "the memory controller and its cgroup.procs cannot be read. Run the node in a cgroup of "
                              "its own, or set every limit to 0")
        want = " ".join(f"+{c}" for c in self.wanted)
        try:
            (base / "cgroup.subtree_control").write_text(want)
        except OSError as e:
            # The doc says a pid may show up more than once in cgroup.procs: compare sets.
            others = set(_read(base / "cgroup.procs").split()) - {str(os.getpid())}
            if others:
                raise CgroupError(
                    f"cannot give {base}'s children the {', '.join(self.wanted)} controllers ({e.strerror or e}): "
                    f"cgroup v2 allows that only for a cgroup without processes of its own, and "
                    f"{len(others)} other process(es) share the node's. Run the node in a cgroup of its own "
                    "(systemd-run --scope -p Delegate=yes ..., or a container), or set every limit to 0") from None
            # Only the node is here: it moves into a leaf of its own, so its cgroup can hand out controllers.
            leaf = base / "polar-node"
            try:
                leaf.mkdir(exist_ok=True)
            except OSError as e2:
                raise CgroupError(f"cannot create the cgroup {leaf}: {e2.strerror or e2}") from None
            _write(leaf / "cgroup.procs", str(os.getpid()))
            _write(base / "cgroup.subtree_control", want)
        parent = base / name
        try:
            parent.mkdir(exist_ok=True)
        except OSError as e:
            raise CgroupError(f"cannot create the cgroup {parent}: {e.strerror or e}") from None
        _write(parent / "cgroup.subtree_control", want)
        return parent

    def episode(self, name: str) -> EpisodeCgroup:
        return EpisodeCgroup(self, name)

    def remove(self) -> None:
        for p in self.parents.values():
            _rmdir(p)


class CgroupView:
    """Reading and emptying a cgroup (one directory per controller on v1, one on v2): its limit events
    (OOM kills, refused forks) and its processes."""

    def __init__(self, version: int, by_ctrl: dict[str, Path], limits: Limits):
        self.version, self.by_ctrl, self.limits = version, by_ctrl, limits  # v2: one directory, under ''
        self.dirs = list(dict.fromkeys(by_ctrl.values()))

    @classmethod
    def of_pid(cls, pid: int, limits: Limits) -> CgroupView | None:
        """The cgroup a process is in (a docker container's init), when this host's cgroup filesystem
        shows it; None otherwise (a remote docker engine, another cgroup namespace)."""
        own = own_cgroups(pid)
        if not own:
            return None
        root2 = v2_root()
        if set(own) == {""} and root2 is not None:
            d = root2 / own[""].lstrip("/")
            return cls(2, {"": d}, limits) if d.is_dir() else None
        mounts = v1_mounts()
        by_ctrl = {c: mounts[c] / own[c].lstrip("/") for c in ("memory", "pids") if c in own and c in mounts}
        by_ctrl = {c: d for c, d in by_ctrl.items() if d.is_dir()}
        return cls(1, by_ctrl, limits) if by_ctrl else None

    def _file(self, ctrl: str, v1: str, v2: str) -> Path | None:
        if self.version == 2:
            return self.dirs[0] / v2
        return self.by_ctrl[ctrl] / v1 if ctrl in self.by_ctrl else None

    def oom_kills(self) -> int:
        f = self._file("memory", "memory.oom_control", "memory.events")
        return _keyed(_read(f), "oom_kill") if f is not None and self.limits.memory else 0

    def forks_refused(self) -> int:
        f = self._file("pids", "pids.events", "pids.events")
        return _keyed(_read(f), "max") if f is not None and self.limits.pids else 0

    def mark(self) -> None:
        """Count limit events from now on (the events files count since the cgroup was made)."""
        self._base = (self.oom_kills(), self.forks_refused())

    def hit(self) -> str:
        """'' while within limits (since mark()), else which limit the episode reached."""
        base = getattr(self, "_base", (0, 0))
        if n := self.oom_kills() - base[0]:
            return (f"memory limit {human(self.limits.memory)} reached: the kernel killed {n} process(es) of the "
                    "sandbox (out of memory)")
        if n := self.forks_refused() - base[1]:
            return f"process limit {self.limits.pids} reached: {n} fork(s) refused"
        return ""

    def pids(self) -> list[int]:
        return sorted({int(p) for d in self.dirs for p in _read(d / "cgroup.procs").split()})

    def kill(self, spare: frozenset[int] = frozenset()) -> None:
        """Kill every process in the cgroup but ``spare`` (a container's init), a fork bomb included:
        under its pids limit it cannot outrun us."""
        if not spare and self.version == 2 and (self.dirs[0] / "cgroup.kill").exists():
            try:
                (self.dirs[0] / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass
        for _ in range(100):
            pids = [p for p in self.pids() if p not in spare]
            if not pids:
                return
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)


class EpisodeCgroup(CgroupView):
    """One episode's cgroup (one per controller on v1), with its limits written before anything runs."""

    def __init__(self, tree: CgroupTree, name: str):
        super().__init__(tree.version, {c: p / name for c, p in tree.parents.items()}, tree.limits)
        for d in self.dirs:
            try:
                d.mkdir()
            except FileExistsError:
                pass
            except OSError as e:
                raise CgroupError(f"cannot create the cgroup {d}: {e.strerror or e}") from None
        try:
            self._set_limits()
        except BaseException:
            self.remove()
            raise
        # The files a pid is written into, by the child before it runs bubblewrap: joining happens
        # before the sandbox exists, so nothing in it ever runs without its limits.
        self.procs = [str(d / "cgroup.procs") for d in self.dirs]

    def _set_limits(self) -> None:
        lim = self.limits
        if self.version == 2:
            d = self.dirs[0]
            if lim.memory:
                _write(d / "memory.max", str(lim.memory))
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")  # the limit is RAM: no paging out past it
            if lim.pids:
                _write(d / "pids.max", str(lim.pids))
            if lim.cpus:
                _write(d / "cpu.max", f"{int(lim.cpus * CFS_PERIOD)} {CFS_PERIOD}")
            return
        if lim.memory:
            d = self.by_ctrl["memory"]
            _write(d / "memory.limit_in_bytes", str(lim.memory))
            if (d / "memory.memsw.limit_in_bytes").exists():  # with swap accounting: no swap past it either
                _write(d / "memory.memsw.limit_in_bytes", str(lim.memory))
        if lim.pids:
            _write(self.by_ctrl["pids"] / "pids.max", str(lim.pids))
        if lim.cpus:
            d = self.by_ctrl["cpu"]
            _write(d / "cpu.cfs_period_us", str(CFS_PERIOD))
            _write(d / "cpu.cfs_quota_us", str(int(lim.cpus * CFS_PERIOD)))

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            _rmdir(d)


def _rmdir(d: Path) -> None:
    # A cgroup whose last process just died may still count it for a moment: retry briefly.
    for _ in range(50):
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)
