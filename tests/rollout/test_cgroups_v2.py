"""The cgroup v2 path of runtimes/cgroups.py, run for real against a fake cgroup2 tree in tmp_path.

This project's machines (and CI) have cgroup v1 only, so test_sandbox_limits.py enforces the limits
on v1; most users' hosts are v2. Here CgroupTree, EpisodeCgroup and CgroupView run their own code;
only the discovery points are replaced (v2_root, own_cgroups, v1_mounts: what /proc/self/mountinfo
and /proc/<pid>/cgroup would say). v2_root hands out the fake tree: a directory whose paths are a
Path subclass (CgroupFsPath) that plays the kernel's part of mkdir, rmdir, reading cgroup.procs and
writing interface files, as Documentation/admin-guide/cgroup-v2.rst documents them:

- a new cgroup holds cgroup.procs, cgroup.controllers (its parent's subtree_control),
  cgroup.subtree_control (empty), cgroup.type ("domain"), cgroup.events, cgroup.kill (kernels from
  5.14) and the interface files of each controller its parent enabled, with their documented
  defaults ("Core Interface Files", "Enabling and Disabling": interface files are created in the
  children when the parent enables a controller);
- cgroup.subtree_control takes "+ctrl -ctrl ..."; a controller not in cgroup.controllers is refused
  (ENOENT); a non-root cgroup with processes cannot enable one (EBUSY, "No Internal Process
  Constraint"); all-or-nothing;
- writing a pid to cgroup.procs moves the process (it leaves its old cgroup); a cgroup with
  controllers enabled in its subtree_control takes none (EBUSY);
- cgroup.kill takes only "1" and SIGKILLs every process of the cgroup and its descendants;
- memory.max, memory.swap.max, pids.max take a number or "max"; cpu.max "$MAX $PERIOD" (or "$MAX");
  the events files (memory.events: low high max oom oom_kill oom_group_kill; pids.events: max) are
  read-only, flat-keyed; no file can be created in the tree (a wrong name is refused: EACCES);
- rmdir of a cgroup with live processes or child cgroups fails (EBUSY).

What this does NOT show: that a v2 kernel enforces these limits (no v2 kernel here); the fake is
this file's reading of the doc. Processes never really change cgroup; pids written to cgroup.procs
are bookkept, and the ones killed are real (`sleep` processes this test starts).
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
from pathlib import Path, PosixPath

import pytest

from harness_recipes.recipes.limits import Limits
from harness_recipes.runtimes import cgroups
from harness_recipes.runtimes.cgroups import CgroupError, CgroupTree, CgroupView

ALL = "cpuset cpu io memory hugetlb pids rdma misc"  # a typical root's cgroup.controllers
# Documented defaults of the interface files a controller puts in each child cgroup.
CTRL_FILES = {
    "memory": {"memory.max": "max", "memory.high": "max", "memory.current": "0",
               "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
               "memory.swap.max": "max"},
    "pids": {"pids.max": "max", "pids.current": "0", "pids.events": "max 0\n"},
    "cpu": {"cpu.max": "max 100000", "cpu.weight": "100"},
    "io": {"io.max": ""},
}
THREADED = {"cpu", "cpuset", "perf_event", "pids"}  # "Threads": the controllers a threaded cgroup may enable
READ_ONLY = {"cgroup.controllers", "cgroup.events", "memory.current", "memory.events", "pids.current", "pids.events"}


def _err(code: int, path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"  # a killed child not yet reaped is dead too


class FakeCgroup2:
    """The kernel's side of a cgroup2 tree rooted at ``root`` (a real directory)."""

    def __init__(self, root: Path, swap: bool = True, kill_file: bool = True):
        self.root, self.swap, self.kill_file = Path(root), swap, kill_file
        self.procs: dict[int, Path] = {}  # pid -> its cgroup
        self.writes: list[tuple[str, str, str]] = []  # (path under root, value, "ok" or errno name), in order
        self.root.mkdir(parents=True)
        for f, v in (("cgroup.controllers", ALL), ("cgroup.subtree_control", ""), ("cgroup.procs", "")):
            (self.root / f).write_text(v)  # the root has no cgroup.type, cgroup.kill or limit files

    def path(self) -> CgroupFsPath:
        return type("BoundCgroupFsPath", (CgroupFsPath,), {"kernel": self})(self.root)

    # -- state ---------------------------------------------------------------------------------------
    def _text(self, d: Path, f: str) -> str:
        return (Path(d) / f).read_text()

    def _set(self, d: Path, f: str, v: str) -> None:
        with open(os.path.join(d, f), "w") as fh:
            fh.write(v)

    def enabled(self, d: Path) -> list[str]:
        return self._text(d, "cgroup.subtree_control").split()

    def _threaded(self, d: Path) -> bool:
        return (Path(d) / "cgroup.type").is_file() and self._text(d, "cgroup.type").strip() in ("threaded",
                                                                                                "domain invalid")

    def read_procs(self, d: Path) -> None:
        if self._threaded(d):  # "cgroup.procs": in a threaded cgroup, reading fails with EOPNOTSUPP
            raise _err(errno.EOPNOTSUPP, Path(d) / "cgroup.procs")
        self.reap()

    def is_cgroup(self, d: Path) -> bool:
        return Path(d).is_dir() and (Path(d) / "cgroup.procs").is_file()

    def children(self, d: Path) -> list[Path]:
        return [c for c in Path(d).iterdir() if self.is_cgroup(c)]

    def reap(self) -> None:
        for pid in [p for p in self.procs if not _alive(p)]:
            del self.procs[pid]
        for d in {Path(p) for p in self.procs.values()} | {Path(p) for p in self._all()}:
            self._set(d, "cgroup.procs", "".join(f"{p}\n" for p, c in self.procs.items() if c == d))

    def _all(self) -> list[Path]:
        return [Path(dp) for dp, _, _ in os.walk(self.root) if self.is_cgroup(Path(dp))]

    def _ctrl_files(self, d: Path, ctrl: str, on: bool) -> None:
        for f, v in CTRL_FILES.get(ctrl, {}).items():
            if f == "memory.swap.max" and not self.swap:
                continue  # no swap accounting in this kernel: the file does not exist
            if on:
                self._set(d, f, v)
            else:
                (Path(d) / f).unlink(missing_ok=True)

    # -- the system calls ----------------------------------------------------------------------------
    def mkdir(self, d: Path) -> None:
        parent = Path(d).parent
        if not self.is_cgroup(parent):
            raise _err(errno.ENOENT, d)
        os.mkdir(d)
        ctrls = self.enabled(parent)
        self._set(d, "cgroup.procs", "")
        self._set(d, "cgroup.controllers", " ".join(ctrls))
        self._set(d, "cgroup.subtree_control", "")
        self._set(d, "cgroup.type", "domain")
        self._set(d, "cgroup.events", "populated 0\nfrozen 0\n")
        if self.kill_file:
            self._set(d, "cgroup.kill", "")
        for c in ctrls:
            self._ctrl_files(d, c, True)

    def rmdir(self, d: Path) -> None:
        if not self.is_cgroup(d):
            raise _err(errno.ENOENT, d)
        self.reap()
        if self.children(d) or any(c == Path(d) for c in self.procs.values()):
            raise _err(errno.EBUSY, d)
        shutil.rmtree(d)

    def write(self, p: Path, value: str) -> None:
        try:
            self._write(Path(p), value)
        except OSError as e:
            self.writes.append((str(Path(p).relative_to(self.root)), value, errno.errorcode[e.errno]))
            raise
        self.writes.append((str(Path(p).relative_to(self.root)), value, "ok"))

    def _write(self, p: Path, value: str) -> None:
        d, name = p.parent, p.name
        if not p.is_file():
            raise _err(errno.EACCES, p)  # cgroupfs has no create: a misspelt or absent file is refused
        if name in READ_ONLY:
            raise _err(errno.EINVAL, p)
        is_root = d == self.root
        if name == "cgroup.procs":
            if not is_root and self.enabled(d):
                raise _err(errno.EBUSY, p)
            self.procs[int(value.strip())] = d
            self.reap()
        elif name == "cgroup.subtree_control":
            on, off = set(), set()
            for tok in value.split():
                if tok[:1] not in "+-" or tok[1:] not in self._text(d, "cgroup.controllers").split():
                    raise _err(errno.ENOENT if tok[:1] in "+-" else errno.EINVAL, p)
                (on if tok[0] == "+" else off).add(tok[1:])
                (off if tok[0] == "+" else on).discard(tok[1:])
            self.reap()
            if on - THREADED and self._threaded(d):
                raise _err(errno.EOPNOTSUPP, p)  # "Threads": only threaded controllers in a threaded subtree
            if on and not is_root and any(c == d for c in self.procs.values()):
                raise _err(errno.EBUSY, p)
            before = self.enabled(d)
            now = [c for c in ALL.split() if (c in before or c in on) and c not in off]
            self._set(d, name, " ".join(now))
            for child in self.children(d):  # the children's interface files come and go with it
                self._set(child, "cgroup.controllers", " ".join(now))
                for c in ALL.split():
                    if (c in before) != (c in now):
                        self._ctrl_files(child, c, c in now)
        elif name == "cgroup.kill":
            if value.strip() != "1":
                raise _err(errno.EINVAL, p)
            for pid, c in list(self.procs.items()):
                if c == d or d in c.parents:
                    os.kill(pid, signal.SIGKILL)
        elif name in ("memory.max", "memory.swap.max", "pids.max"):
            if not (value.strip() == "max" or value.strip().isdigit()):
                raise _err(errno.EINVAL, p)
            self._set(d, name, value.strip())
        elif name == "cpu.max":
            parts = value.split()
            if not (1 <= len(parts) <= 2 and (parts[0] == "max" or parts[0].isdigit())
                    and all(x.isdigit() for x in parts[1:])):
                raise _err(errno.EINVAL, p)
            period = parts[1] if len(parts) == 2 else self._text(d, name).split()[1]
            self._set(d, name, f"{parts[0]} {period}")
        else:
            self._set(d, name, value)

    # -- what the kernel would count -----------------------------------------------------------------
    def event(self, d: Path, f: str, key: str, n: int = 1) -> None:
        lines = [ln.split() for ln in self._text(d, f).splitlines()]
        self._set(d, f, "".join(f"{k} {int(v) + n if k == key else v}\n" for k, v in lines))


class CgroupFsPath(PosixPath):
    """A path in the fake tree: the operations the code under test does, answered by ``kernel``."""

    kernel: FakeCgroup2

    def _ours(self) -> bool:
        return self.kernel.root == self or self.kernel.root in self.parents

    def mkdir(self, mode=0o777, parents=False, exist_ok=False):
        if not self._ours():
            return super().mkdir(mode, parents, exist_ok)
        if self.exists():
            if exist_ok and self.is_dir():
                return
            raise _err(errno.EEXIST, self)
        self.kernel.mkdir(Path(self))

    def rmdir(self):
        if not self._ours():
            return super().rmdir()
        self.kernel.rmdir(Path(self))

    def read_text(self, encoding=None, errors=None):
        if self._ours() and self.name == "cgroup.procs":
            self.kernel.read_procs(Path(self.parent))
        return super().read_text(encoding, errors)

    def write_text(self, data, encoding=None, errors=None, newline=None):
        if not self._ours():
            return super().write_text(data, encoding, errors, newline)
        self.kernel.write(Path(self), data)
        return len(data)


NODE = "system.slice/polar.service"


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A v2 host: the node (this process) in NODE, memory pids cpu io delegated down to it."""
    kernel = FakeCgroup2(tmp_path / "cgroup")
    setup(kernel, NODE, "+memory +pids +cpu +io", {os.getpid(): NODE})
    discover(monkeypatch, kernel, NODE)
    return kernel


def setup(kernel: FakeCgroup2, node: str, ctrls: str, procs: dict[int, str]) -> None:
    """What systemd would have done before the node starts, then forget those writes."""
    d = kernel.root
    for part in Path(node).parts:
        kernel.write(d / "cgroup.subtree_control", ctrls)
        d = d / part
        kernel.mkdir(d)
    for pid, where in procs.items():
        kernel.write(kernel.root / where / "cgroup.procs", str(pid))
    kernel.writes.clear()


def discover(monkeypatch, kernel: FakeCgroup2, node: str, v1: dict | None = None) -> None:
    root = kernel.path()
    monkeypatch.setattr(cgroups, "v2_root", lambda: root)
    monkeypatch.setattr(cgroups, "own_cgroups", lambda pid="self": {"": "/" + node.strip("/")})
    monkeypatch.setattr(cgroups, "v1_mounts", lambda: dict(v1 or {}))


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []

    def start(n: int) -> list[subprocess.Popen]:
        new = [subprocess.Popen(["sleep", "30"]) for _ in range(n)]
        started.extend(new)
        return new
    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def died_of_sigkill(procs) -> bool:
    return all(p.wait(timeout=5) == -signal.SIGKILL for p in procs)


LIM = Limits(memory=256 << 20, pids=64, cpus=1.5)


def test_alone_in_its_cgroup_the_node_moves_to_a_leaf_and_limits_are_written(fake, sleepers):
    tree = CgroupTree(LIM)
    parent = f"{NODE}/polar-{os.getpid()}"
    assert tree.version == 2 and tree.parents == {"": fake.root / parent}
    ep = tree.episode("ep1")
    d = fake.root / parent / "ep1"
    assert fake.writes == [
        # refused while the node is in its cgroup (no internal processes), then the node moves out
        (f"{NODE}/cgroup.subtree_control", "+memory +pids +cpu", "EBUSY"),
        (f"{NODE}/polar-node/cgroup.procs", str(os.getpid()), "ok"),
        # top-down: the node's cgroup first, then the node's parent of all its episodes
        (f"{NODE}/cgroup.subtree_control", "+memory +pids +cpu", "ok"),
        (f"{parent}/cgroup.subtree_control", "+memory +pids +cpu", "ok"),
        # bytes; no swap past the memory limit; a process count; quota and period in microseconds
        (f"{parent}/ep1/memory.max", str(256 << 20), "ok"),
        (f"{parent}/ep1/memory.swap.max", "0", "ok"),
        (f"{parent}/ep1/pids.max", "64", "ok"),
        (f"{parent}/ep1/cpu.max", "150000 100000", "ok"),
    ]
    assert fake.procs[os.getpid()] == fake.root / NODE / "polar-node"
    assert (fake.root / NODE / "cgroup.procs").read_text() == ""
    assert (fake.root / NODE / "cgroup.subtree_control").read_text().split() == ["cpu", "memory", "pids"]
    assert (d / "memory.max").read_text() == "268435456" and (d / "cpu.max").read_text() == "150000 100000"
    assert (d / "pids.max").read_text() == "64" and (d / "memory.swap.max").read_text() == "0"
    assert ep.procs == [str(d / "cgroup.procs")]

    # the bubblewrap child joins through ep.procs before exec; sleeps stand in for the sandbox
    box = sleepers(3)
    for p in box:
        fake.write(Path(ep.procs[0]), str(p.pid))
    assert ep.pids() == sorted(p.pid for p in box)

    ep.mark()
    assert ep.hit() == ""
    fake.event(d, "memory.events", "oom_group_kill")  # not an oom_kill: the key is matched exactly
    fake.event(d, "memory.events", "max", 5)  # reclaim at the limit, no kill
    assert ep.hit() == ""
    fake.event(d, "memory.events", "oom_kill")
    assert ep.hit() == ("memory limit 256 MiB reached: the kernel killed 1 process(es) of the sandbox "
                        "(out of memory)")
    ep.mark()
    assert ep.hit() == ""
    fake.event(d, "pids.events", "max", 3)
    assert ep.hit() == "process limit 64 reached: 3 fork(s) refused"

    fake.writes.clear()
    ep.remove()  # kills through cgroup.kill, then the cgroup goes
    assert fake.writes == [(f"{parent}/ep1/cgroup.kill", "1", "ok")]
    assert died_of_sigkill(box)
    assert not d.exists()
    tree.remove()
    assert not (fake.root / parent).exists()
    assert (fake.root / NODE / "polar-node").is_dir()  # the node still runs there


def test_a_node_sharing_its_cgroup_is_refused_with_the_reason(tmp_path, monkeypatch, sleepers):
    kernel = FakeCgroup2(tmp_path / "cgroup")
    other = sleepers(1)[0]
    setup(kernel, NODE, "+memory +pids +cpu", {os.getpid(): NODE, other.pid: NODE})
    discover(monkeypatch, kernel, NODE)
    with pytest.raises(CgroupError, match=r"cgroup v2 allows that only for a cgroup without processes of its own, "
                                          r"and 1 other process\(es\) share the node's.*Delegate=yes"):
        CgroupTree(LIM)
    assert kernel.writes == [(f"{NODE}/cgroup.subtree_control", "+memory +pids +cpu", "EBUSY")]
    assert not (kernel.root / NODE / "polar-node").exists()  # nothing moved, nothing made
    assert kernel.procs[os.getpid()] == kernel.root / NODE


def test_a_node_in_the_root_cgroup_needs_no_leaf(tmp_path, monkeypatch):
    """A container with its own cgroup namespace sees itself at '/': the root takes controllers even
    with processes in it (the root is exempt from the no-internal-process rule)."""
    kernel = FakeCgroup2(tmp_path / "cgroup")
    kernel.write(kernel.root / "cgroup.procs", str(os.getpid()))
    kernel.writes.clear()
    discover(monkeypatch, kernel, "/")
    tree = CgroupTree(Limits(memory=64 << 20, pids=0, cpus=0))
    assert kernel.writes == [("cgroup.subtree_control", "+memory", "ok"),
                             (f"polar-{os.getpid()}/cgroup.subtree_control", "+memory", "ok")]
    ep = tree.episode("e")
    assert kernel.writes[2:] == [(f"polar-{os.getpid()}/e/memory.max", str(64 << 20), "ok"),
                                 (f"polar-{os.getpid()}/e/memory.swap.max", "0", "ok")]
    assert not (kernel.root / "polar-node").exists()
    ep.remove()
    tree.remove()
    assert not (kernel.root / f"polar-{os.getpid()}").exists()


def test_without_swap_accounting_only_memory_max_is_written(tmp_path, monkeypatch):
    kernel = FakeCgroup2(tmp_path / "cgroup", swap=False)
    setup(kernel, NODE, "+memory +pids +cpu", {os.getpid(): NODE})
    discover(monkeypatch, kernel, NODE)
    tree = CgroupTree(Limits(memory=32 << 20, pids=0, cpus=0))
    n = len(kernel.writes)
    ep = tree.episode("e")
    assert [w[:2] for w in kernel.writes[n:]] == [(f"{NODE}/polar-{os.getpid()}/e/memory.max", str(32 << 20))]
    ep.remove()
    tree.remove()


def test_a_controller_not_delegated_is_named(tmp_path, monkeypatch):
    """systemd before v244 delegated only memory and pids to a user's cgroups: cpu is not offered."""
    kernel = FakeCgroup2(tmp_path / "cgroup")
    setup(kernel, NODE, "+memory +pids", {os.getpid(): NODE})
    discover(monkeypatch, kernel, NODE)
    with pytest.raises(CgroupError, match=r"not given the cpu controller\(s\) \(its cgroup.controllers: memory pids\)"):
        CgroupTree(LIM)
    assert kernel.writes == [] and kernel.procs[os.getpid()] == kernel.root / NODE  # the node did not move
    tree = CgroupTree(Limits(memory=64 << 20, pids=100, cpus=0))  # without the CPU limit it works
    assert (tree.parents[""] / "cgroup.subtree_control").read_text() == "memory pids"
    tree.remove()


def test_a_threaded_cgroup_is_refused(fake):
    """In a threaded cgroup memory cannot be enabled (EOPNOTSUPP) and cgroup.procs cannot be read: the
    reason is the cgroup's type, not processes sharing it."""
    fake._set(fake.root / NODE, "cgroup.type", "threaded")
    with pytest.raises(CgroupError, match="of type 'threaded'"):
        CgroupTree(LIM)
    assert fake.writes == []


def test_v2_offering_no_memory_controller_falls_back_to_v1(tmp_path, monkeypatch):
    """A hybrid host: the unified tree exists but its controllers are bound to v1 hierarchies."""
    kernel = FakeCgroup2(tmp_path / "cgroup")
    kernel._set(kernel.root, "cgroup.controllers", "hugetlb")
    discover(monkeypatch, kernel, "/")
    with pytest.raises(CgroupError, match="no cgroup controller memory, pids, cpu here"):
        CgroupTree(LIM)
    assert kernel.writes == []


def test_kill_without_cgroup_kill_signals_each_pid(tmp_path, monkeypatch, sleepers):
    """Kernels before 5.14 have no cgroup.kill: the pids listed in cgroup.procs are signalled."""
    kernel = FakeCgroup2(tmp_path / "cgroup", kill_file=False)
    setup(kernel, NODE, "+memory +pids +cpu", {os.getpid(): NODE})
    discover(monkeypatch, kernel, NODE)
    tree = CgroupTree(LIM)
    ep = tree.episode("e")
    box = sleepers(4)
    for p in box:
        kernel.write(Path(ep.procs[0]), str(p.pid))
    n = len(kernel.writes)
    ep.kill()
    assert died_of_sigkill(box) and ep.pids() == [] and kernel.writes[n:] == []
    ep.remove()
    tree.remove()
    assert not tree.parents[""].exists()


def test_kill_sparing_a_containers_init_signals_the_others(fake, sleepers, monkeypatch):
    """docker's view of a container on a v2 host (CgroupView.of_pid): its init is spared, so
    cgroup.kill (which would kill it too) is not used; nothing spared, cgroup.kill is."""
    scope = "system.slice/docker-abc.scope"
    d = fake.root / scope
    fake.mkdir(d)
    init, *rest = sleepers(3)
    for p in (init, *rest):
        fake.write(d / "cgroup.procs", str(p.pid))
    fake.writes.clear()
    monkeypatch.setattr(cgroups, "own_cgroups", lambda pid="self": {"": "/" + scope} if pid == init.pid else {})
    view = CgroupView.of_pid(init.pid, Limits(memory=512 << 20, pids=100))
    assert view is not None and view.version == 2 and view.dirs == [d]
    assert CgroupView.of_pid(os.getpid(), Limits()) is None  # a pid this host's tree does not show
    assert view.pids() == sorted(p.pid for p in (init, *rest))
    view.mark()
    fake.event(d, "memory.events", "oom_kill", 2)
    assert view.hit().startswith("memory limit 512 MiB reached: the kernel killed 2 process(es)")
    view.kill(spare=frozenset({init.pid}))
    assert died_of_sigkill(rest) and init.poll() is None
    assert view.pids() == [init.pid] and fake.writes == []
    view.kill()
    assert fake.writes == [(f"{scope}/cgroup.kill", "1", "ok")] and died_of_sigkill([init])


def test_the_fake_refuses_what_the_kernel_refuses(fake):
    """The fake tree itself: a wrong name, format or order fails here as on a v2 kernel, so the
    tests above would catch one in the code."""
    d = fake.root / "system.slice"  # offers memory pids cpu io to its children
    fake.mkdir(d / "x")
    for f, v in (("memory.limit_in_bytes", "1"), ("memory.max", "256m "), ("cpu.max", "1.5 100000"),
                 ("memory.events", "oom_kill 0"), ("cgroup.kill", "0")):
        with pytest.raises(OSError):
            fake.write(d / "x" / f, v)
    with pytest.raises(OSError) as e:  # a controller the parent does not offer
        fake.write(d / "x" / "cgroup.subtree_control", "+rdma")
    assert e.value.errno == errno.ENOENT
    with pytest.raises(OSError) as e:  # the grandchild cannot enable what its parent has not
        fake.mkdir(d / "x" / "y")
        fake.write(d / "x" / "y" / "cgroup.subtree_control", "+memory")
    assert e.value.errno == errno.ENOENT
    fake.write(d / "x" / "cgroup.subtree_control", "+memory")
    assert (d / "x" / "y" / "memory.max").read_text() == "max"  # enabling made the child's files
    with pytest.raises(OSError) as e:  # controllers enabled: no processes of its own
        fake.write(d / "x" / "cgroup.procs", str(os.getpid()))
    assert e.value.errno == errno.EBUSY
    with pytest.raises(OSError) as e:  # a child cgroup still there
        fake.rmdir(d / "x")
    assert e.value.errno == errno.EBUSY
