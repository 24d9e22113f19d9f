"""The docker runtime: one container per episode, through the docker SDK.

Image: built locally, never pulled. `polar-rollout-base` is a `docker import` of a skeleton root
(directories and the usr-merge symlinks); the host's /usr and /etc are bind-mounted read-only, so
the container runs the host's node, python and git without copying gigabytes into an image. The
harness recipe's own install prefix is mounted read-only at the same path, the episode directory (workspace +
home) read-write at the same path, so recipe templates render identically under both runtimes.

SWE-bench tasks (task.swebench) run in their instance's image instead, which the task resolves
(tasks/swebench/images.py: the official image when docker has it, else one built from a
debootstrap'ed Debian base); the runtime runs it, the repository at /testbed, with only the recipe's
install prefix, the episode directory and the host's node binary mounted.
A container that stops under a command (killed, OOM) raises ContainerGone with docker's account
of why: the episode ends as an infrastructure error, not as the harness's failure.

Network: `none`, always: the container has only its own loopback. The model API comes in through
a per-episode Unix socket (api_socket.py) in a directory mounted read-only at /run/polar, and the
harness runs behind the inner forwarder (the container's own python3: an image without one fails the
episode, saying so). No capabilities, no-new-privileges; /etc less its secrets.

Limits (recipes/limits.py): docker's own flags: --memory (and --memory-swap at the same value: no swap past
it), --cpus, --pids-limit; disk: --storage-opt size= where the engine's storage driver supports it
(overlay2 on xfs with pquota, btrfs, zfs), else a disk watchdog over the container's writable layer
(docker's SizeRw) and the episode's bind-mounted workspace and home; /tmp is a tmpfs of at most the
disk limit and no file may outgrow it (ulimit fsize) either way. While a command runs, its limits are
watched (the container's cgroup, when this host's cgroup filesystem shows it: OOM kills, refused
forks); a command that reaches one is stopped, every process of the container but its init killed, and
its ExecResult says which limit: the episode ends as resource_limit.

Cleanup: every container carries a per-run label; close() removes it (force), and
shutdown() sweeps any container of the run still there, whatever path the run left by.
"""
from __future__ import annotations

import asyncio
import io
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path

from harness_recipes.docker_engine import docker_client, exec_wait
from harness_recipes.recipes.limits import Limits
from harness_recipes.tasks.swebench.images import image_path, task_image
from harness_recipes.tasks.task_file import Task

from ..cache import install_prefix
from .api_socket import SANDBOX_DIR, ApiSocket
from .base import OUTPUT_CAP, ExecResult, Runtime, Sandbox, populate_workspace
from .cgroups import CgroupView
from .file_tree import ObjectStore, Snapshot, snapshot_tar
from .limits import LimitHit, disk_reason, disk_usage
from .local import ETC_HIDDEN

IMAGE = "polar-rollout-base:2"
WORKDIR = "/testbed"  # where SWE-bench images hold the repository
NODE_DIR = "/opt/polar/bin"  # the host's node, mounted for the npm harnesses in instance images
NODE_HOME = "/opt/polar/node"  # ... and, when it needs them, its libraries (node_mounts)
LABEL = "polar.rollout.run"
# /sbin is a real directory, not the usr-merge link: docker mounts its init at /sbin/docker-init,
# which cannot be created inside the read-only /usr.
SKELETON_DIRS = ("usr", "etc", "tmp", "proc", "sys", "dev", "root", "var", "var/tmp", "run", "home", "sbin")
USR_MERGE = {"bin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64"}


def skeleton_tar() -> bytes:
    """A root filesystem of empty directories and the usr-merge links, as a tar archive."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in SKELETON_DIRS:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o1777 if d in ("tmp", "var/tmp") else 0o755, 0
            tar.addfile(info)
        for name, target in USR_MERGE.items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mtime = tarfile.SYMTYPE, target, 0
            tar.addfile(info)
    return buf.getvalue()


def ensure_image(client) -> str:
    import docker
    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        # The SDK's import_image(data=...) wraps `docker import`: a local tarball, nothing pulled.
        repo, tag = IMAGE.split(":")
        client.api.import_image_from_data(skeleton_tar(), repository=repo, tag=tag)
        client.images.get(IMAGE)
    return IMAGE


class DockerSandbox(Sandbox):
    def __init__(self, client, container, root: Path, workspace: str | None = None, node_dir: str | None = None,
                 image: str = "", limits: Limits | None = None, disk_by_driver: bool = False):
        self.client, self.container, self.root = client, container, root
        self.workspace = workspace or str(root / "workspace")
        self.home = str(root / "home")
        self.image = image
        self.isolation = "docker"
        if node_dir:
            self.node_dir = node_dir  # the scheduler puts it first on the harness's PATH
        self.limits = limits or Limits()
        self.disk_by_driver = disk_by_driver  # the writable layer's size is the storage driver's to bound
        self.limit_hit = ""  # the limit that stopped a command: the episode's end reason
        self._cgroup: CgroupView | None = None
        self._init_pid: int | None = None
        self._spare: frozenset[int] = frozenset()  # the container's own processes: its init and sleeper
        self._closed = False

    def _exec(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str) -> ExecResult:
        import docker
        t0 = time.monotonic()
        # coreutils timeout runs the command in its own process group and kills the whole group.
        wrapped = ["timeout", "-k", "3", f"{timeout:.3f}", *argv]
        if (view := self._view()) is not None:
            view.mark()  # limit events from this command on
        stop = threading.Event()
        hit: list[str] = []
        watcher = threading.Thread(target=self._watch, args=(stop, hit), daemon=True)
        watcher.start()
        try:
            exit_code, output = exec_wait(self.container, wrapped, environment=env, workdir=cwd)
        except docker.errors.APIError as e:
            if hit:  # the watcher stopped the container: the limit, not docker, ended the command
                return self._limited(hit[0], t0)
            raise ContainerGone(self._why_gone(e)) from None
        finally:
            stop.set()
            watcher.join()
        if not hit and (reason := self._check()):  # an OOM kill that ended the command before the next look
            hit.append(reason)
        if hit:
            return self._limited(hit[0], t0, output)
        if exit_code is None or exit_code == 137 and time.monotonic() - t0 < timeout and self._dead():
            raise ContainerGone(self._why_gone(None))
        out, err = output if output else (b"", b"")
        seconds = time.monotonic() - t0
        timed_out = exit_code in (124, 137) and seconds >= timeout
        return ExecResult(rc=None if timed_out else exit_code, stdout=(out or b"")[:OUTPUT_CAP],
                          stderr=(err or b"")[:OUTPUT_CAP], timed_out=timed_out, seconds=seconds)

    def _limited(self, reason: str, t0: float, output=None) -> ExecResult:
        self.limit_hit = reason
        out, err = output if output else (b"", b"")
        return ExecResult(rc=None, stdout=(out or b"")[:OUTPUT_CAP], stderr=(err or b"")[:OUTPUT_CAP],
                          timed_out=False, seconds=time.monotonic() - t0, limit=reason)

    # ---- limits, watched while a command runs ----------------------------------------------------

    def _view(self) -> CgroupView | None:
        """The container's cgroup on this host (found once, by its init's pid), or None."""
        if self._init_pid is None:
            try:
                self.container.reload()
                self._init_pid = int(self.container.attrs.get("State", {}).get("Pid") or 0)
            except Exception:  # noqa: BLE001  (gone: nothing to watch, docker reports the death)
                self._init_pid = 0
            self._cgroup = CgroupView.of_pid(self._init_pid, self.limits) if self._init_pid else None
            if self._cgroup is not None:
                # Its init's children now are the container's own (`sleep infinity`): commands run by
                # exec are the engine's children, though orphans of theirs are handed to the init later.
                kids = Path(f"/proc/{self._init_pid}/task/{self._init_pid}/children")
                try:
                    self._spare = frozenset({self._init_pid, *map(int, kids.read_text().split())})
                except OSError:
                    self._spare = frozenset({self._init_pid})
        return self._cgroup

    def _disk_used(self) -> tuple[int, str]:
        paths = [Path(self.home)] + ([Path(self.workspace)] if Path(self.workspace).is_dir() else [])
        used = disk_usage(paths, self.limits.disk)
        what = "the workspace and home"
        if not self.disk_by_driver:
            try:
                size_rw = self.client.api.inspect_container(self.container.id, size=True).get("SizeRw") or 0
            except Exception:  # noqa: BLE001  (gone: docker reports the death)
                size_rw = 0
            used += size_rw
            what += " and the container's writable layer"
        return used, what

    def _check(self, disk: bool = False) -> str:
        view = self._view()
        if view is not None and (reason := view.hit()):
            return reason
        if not view and self._oom_killed():
            return f"memory limit {self.limits.memory} bytes reached: docker reports the container OOM-killed"
        if disk and self.limits.disk:
            used, what = self._disk_used()
            if used > self.limits.disk:
                return disk_reason(used, self.limits.disk, what)
        return ""

    def _oom_killed(self) -> bool:
        try:
            self.container.reload()
            return bool(self.container.attrs.get("State", {}).get("OOMKilled"))
        except Exception:  # noqa: BLE001
            return False

    def _watch(self, stop: threading.Event, hit: list[str]) -> None:
        """Every half second (the disk every disk_poll seconds): a limit reached stops the command."""
        last_disk = 0.0
        while not stop.wait(0.5):
            disk = time.monotonic() - last_disk >= self.limits.disk_poll
            if disk:
                last_disk = time.monotonic()
            if reason := self._check(disk):
                hit.append(reason)
                self._stop_all()
                return

    def _stop_all(self) -> None:
        """Kill every process of the container but its init (the container lives on: its workspace is
        read and graded); without its cgroup in sight, stop the container."""
        view = self._view()
        if view is not None:
            view.kill(spare=self._spare)
            return
        try:
            self.container.kill()
        except Exception:  # noqa: BLE001  (already gone)
            pass

    def _dead(self) -> bool:
        import docker
        try:
            self.container.reload()
        except docker.errors.NotFound:
            return True
        return self.container.status != "running"

    def _why_gone(self, err) -> str:
        import docker
        try:
            self.container.reload()
            st = self.container.attrs.get("State", {})
            state = (f"status {st.get('Status')}, exit code {st.get('ExitCode')}, "
                     f"OOM-killed {st.get('OOMKilled')}{', error ' + st['Error'] if st.get('Error') else ''}")
        except docker.errors.NotFound:
            state = "removed"
        detail = f" ({type(err).__name__}: {str(err)[:300]})" if err is not None else ""
        return f"container {self.container.short_id} ({self.image or 'episode'}) died: {state}{detail}"

    async def exec(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str | None = None) -> ExecResult:
        if self._closed:
            raise RuntimeError("sandbox already closed")
        # The blocking exec runs in a thread; on cancel, close() removes the container, which ends it.
        return await asyncio.to_thread(self._exec, argv, env, timeout, cwd or self.workspace)

    async def snapshot(self, store: ObjectStore) -> Snapshot:
        """The workspace's file tree through docker's archive API (`docker cp`): read by the node, with
        nothing run in the container."""
        def read() -> Snapshot:
            import docker
            # The container's PID 1 sleeps forever: stopped now means it died under the harness (an
            # infrastructure failure, the episode's error), even when the harness's exec came back
            # before docker reported the death; or we stopped it, at a limit.
            if self._dead():
                if self.limit_hit:
                    raise LimitHit(self.limit_hit)
                raise ContainerGone(self._why_gone(None))
            try:
                chunks, _ = self.container.get_archive(self.workspace)
            except docker.errors.APIError as e:
                raise ContainerGone(self._why_gone(e)) from None
            return snapshot_tar(chunks, store)
        return await asyncio.to_thread(read)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.close_api()
        await asyncio.to_thread(_remove, self.container)
        await asyncio.to_thread(shutil.rmtree, self.root, True)


# Libraries every glibc Linux image has: the host's node may rely on the image's own copies.
BASE_LIBS = {"linux-vdso.so.1", "libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
             "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1"}


def extra_libs(ldd_output: str) -> dict[str, str]:
    """name -> host path of each shared library in `ldd` output that is not in BASE_LIBS."""
    out = {}
    for line in ldd_output.splitlines():
        name, _, rest = line.strip().partition(" => ")
        path = rest.split(" (")[0].strip()
        if rest and name not in BASE_LIBS and path.startswith("/"):
            out[name] = path
    return out


def node_mounts(workdir: str | None) -> dict:
    """The npm harnesses' launcher in an instance image: the host's node binary, read-only, at
    NODE_DIR/node. A node that needs libraries beyond glibc and libstdc++ (Debian's own nodejs links
    libnode, libuv, ICU) gets them mounted beside it and a wrapper that sets LD_LIBRARY_PATH for node
    (its children inherit it: with a self-contained node, as nodesource's, there is no wrapper)."""
    node = shutil.which("node")
    if not node:
        return {}
    real = str(Path(node).resolve())
    proc = subprocess.run(["ldd", real], capture_output=True, text=True)
    libs = extra_libs(proc.stdout) if proc.returncode == 0 else {}
    if not libs:
        return {real: {"bind": f"{NODE_DIR}/node", "mode": "ro"}}
    wrap_dir = Path(tempfile.mkdtemp(prefix="polar-node-", dir=workdir))
    (wrap_dir / "node").write_text(f'#!/bin/sh\nLD_LIBRARY_PATH={NODE_HOME}/lib exec {NODE_HOME}/node.real "$@"\n')
    (wrap_dir / "node").chmod(0o755)
    vols = {real: {"bind": f"{NODE_HOME}/node.real", "mode": "ro"},
            str(wrap_dir / "node"): {"bind": f"{NODE_DIR}/node", "mode": "ro"}}
    for name, path in libs.items():
        vols[str(Path(path).resolve())] = {"bind": f"{NODE_HOME}/lib/{name}", "mode": "ro"}
    return vols


class ContainerGone(RuntimeError):
    """The episode's container stopped under a command (killed, OOM, removed): an infrastructure failure."""


def _remove(container) -> None:
    import docker
    try:
        container.remove(force=True)
    except docker.errors.NotFound:
        pass


def _hidden_etc() -> dict:
    """Mounts that hide /etc's secrets under the read-only /etc (files only: docker mounts files here)."""
    return {"/dev/null": [p for p in ETC_HIDDEN if Path(p).is_file() and not Path(p).is_symlink()]}


class DockerRuntime(Runtime):
    name = "docker"
    isolation = "docker"
    # Grading starts a new container (the instance's image, or a fresh workspace copy): network none,
    # only its own episode directories mounted (no harness cache, no node), the agent's container removed.
    grading = "fresh-container"

    def __init__(self, network: str = "none", memory: str | int | None = None, cpus: float | None = None,
                 pids: int | None = None, workdir: str | None = None, log=None, limits: Limits | None = None):
        if network != "none":
            raise ValueError(f"docker network must be none, not {network!r}: a container reaches only its model "
                             "API, through the episode's Unix socket (no host network, no bridges)")
        # memory, cpus, pids: the older way to give them, still taken; they win over ``limits``.
        self.limits = (limits or Limits()).merged({"memory": memory, "cpus": cpus, "pids": pids})
        self.network, self.memory, self.cpus, self.pids = (network, self.limits.memory, self.limits.cpus,
                                                           self.limits.pids)
        # --storage-opt size=: tried on the first container; an engine whose storage driver cannot
        # (overlay2 not on xfs with pquota, vfs, ...) answers so, and the disk watchdog takes over.
        self.disk_by_driver: bool | None = None if self.limits.disk else False
        self._python: dict[str, str] = {}  # image -> its python3, for the inner forwarder
        self.workdir = workdir
        self.client = docker_client()
        self.image = ensure_image(self.client)
        self.run_label = uuid.uuid4().hex[:12]
        self.images: dict[str, tuple[str, str]] = {}  # instance id -> (image, how it was found)
        self._node: dict | None = None  # the host's node, as mounts into instance images
        self.log = log or (lambda m: None)

    @staticmethod
    def _episode_volumes(root: Path, api: ApiSocket | None, workspace: bool = True) -> dict:
        """The episode's own directories (workspace, home) read-write, at their host paths (not the
        episode directory itself: the harness's output and records never sit there), and the model
        API's socket directory read-only."""
        vols = {str(root / "home"): {"bind": str(root / "home"), "mode": "rw"}}
        if workspace:
            vols[str(root / "workspace")] = {"bind": str(root / "workspace"), "mode": "rw"}
        if api is not None:
            vols[str(api.dir)] = {"bind": SANDBOX_DIR, "mode": "ro"}
        return vols

    @staticmethod
    def _harness_mount(harness_prefix: Path | None) -> dict:
        """The recipe's own install prefix, read-only (not the whole harness cache: other harnesses
        and their caches are not the agent's business); nothing for an executable outside it."""
        src = install_prefix(harness_prefix) if harness_prefix is not None else None
        if src is None:
            return {}
        src = src.resolve()
        return {str(src): {"bind": str(src), "mode": "ro"}}

    def _volumes(self, root: Path, api: ApiSocket | None, grading: bool = False,
                 harness_prefix: Path | None = None) -> list[str]:
        vols = {
            "/usr": {"bind": "/usr", "mode": "ro"},
            "/etc": {"bind": "/etc", "mode": "ro"},
            **({} if grading else self._harness_mount(harness_prefix)),
            **self._episode_volumes(root, api),
        }
        binds = [f"{src}:{v['bind']}:{v['mode']}" for src, v in vols.items()]
        return binds + [f"/dev/null:{p}:ro" for p in _hidden_etc()["/dev/null"]]

    def _limit_args(self, storage: bool) -> dict:
        import docker
        lim = self.limits
        args: dict = {"pids_limit": lim.pids or -1}
        if lim.memory:
            args.update(mem_limit=lim.memory, memswap_limit=lim.memory)  # the same: no swap past the limit
        if lim.cpus:
            args["nano_cpus"] = int(lim.cpus * 1e9)
        tmp = min(lim.disk, 512 << 20) if lim.disk else 512 << 20
        args["tmpfs"] = {"/tmp": f"rw,size={tmp}"}
        if lim.disk:
            args["ulimits"] = [docker.types.Ulimit(name="fsize", soft=lim.disk, hard=lim.disk)]
        if storage:
            args["storage_opt"] = {"size": str(lim.disk)}
        return args

    def _run(self, image: str, volumes, workdir: str, root: Path, eid: str):
        import docker

        def run(storage: bool):
            return self.client.containers.run(
                image, ["sleep", "infinity"], detach=True, network_mode="none", **self._limit_args(storage),
                volumes=volumes, working_dir=workdir, init=True, cap_drop=["ALL"],
                security_opt=["no-new-privileges"], labels={LABEL: self.run_label, "polar.episode": eid},
                environment={"HOME": str(root / "home")}, hostname="sandbox",
            )
        if self.disk_by_driver is None:
            try:
                container = run(True)
                self.disk_by_driver = True
                return container
            except docker.errors.APIError as e:
                if "storage" not in str(e).lower() and "quota" not in str(e).lower():
                    raise
                self._remove_episode(eid)  # the container it created, if any, before trying without
                self.disk_by_driver = False
                self.log(f"docker: the storage driver cannot bound a container's writable layer ({str(e)[:200]}); "
                         f"the disk limit ({self.limits.disk} bytes) is kept by a watchdog instead")
        return run(self.disk_by_driver)

    def _sandbox(self, container, root: Path, **kw) -> DockerSandbox:
        sandbox = DockerSandbox(self.client, container, root, limits=self.limits,
                                disk_by_driver=bool(self.disk_by_driver), **kw)
        sandbox._view()  # its cgroup and own processes, found before anything else runs in it
        return sandbox

    def _start(self, root: Path, eid: str, api: ApiSocket | None = None, grading: bool = False,
               harness_prefix: Path | None = None):
        return self._run(self.image, self._volumes(root, api, grading, harness_prefix), str(root / "workspace"),
                         root, eid)

    async def _with_api(self, sandbox: DockerSandbox, api: ApiSocket | None) -> DockerSandbox:
        """Give the sandbox its way in: the image's python3 runs the inner forwarder; none: the episode
        fails here, saying why (it could not reach its model API)."""
        if api is None:
            return sandbox
        sandbox.api = api
        if sandbox.image not in self._python:
            res = await sandbox.exec(["sh", "-c", "command -v python3"],
                                     {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:"
                                              "/opt/conda/bin:/opt/miniconda3/bin"}, timeout=30)
            found = res.stdout.decode(errors="replace").strip()
            if res.rc != 0 or not found.startswith("/"):
                raise RuntimeError(f"image {sandbox.image}: no python3 in the sandbox; the model API's forwarder "
                                   "(inner_forwarder.py) runs with the sandbox's own python3, so the harness "
                                   "could not reach its model. Use an image with python3")
            self._python[sandbox.image] = found
        sandbox.python = self._python[sandbox.image]
        return sandbox

    async def prepare(self, task: Task, episode_id: str, harness_prefix: Path, upstream: str | None = None,
                      grading: bool = False) -> Sandbox:
        if task.swebench is not None:
            return await self._prepare_instance(task, episode_id, upstream, grading, harness_prefix)
        root = Path(tempfile.mkdtemp(prefix=f"polar-{episode_id}-", dir=self.workdir))
        api = None
        try:
            (root / "home").mkdir()
            await asyncio.to_thread(populate_workspace, task, root / "workspace")
            api = await ApiSocket(upstream).start() if upstream is not None else None
            container = await asyncio.to_thread(self._start, root, episode_id, api, grading, harness_prefix)
            sandbox = self._sandbox(container, root, image=self.image)
            return await self._with_api(sandbox, api)
        except BaseException:
            await self._abandon(episode_id, api, root)
            raise

    async def prepare_grading(self, task: Task, episode_id: str, harness_prefix: Path) -> Sandbox:
        return await self.prepare(task, episode_id, harness_prefix, grading=True)

    # ---- SWE-bench instances: the instance's own image, the repository at /testbed in it ----------

    def _instance_volumes(self, root: Path, api: ApiSocket | None = None, harness_prefix: Path | None = None) -> dict:
        vols = {**self._harness_mount(harness_prefix), **self._episode_volumes(root, api, workspace=False)}
        if self._node is None:
            self._node = node_mounts(self.workdir)
        return {**vols, **self._node}

    def _start_instance(self, image: str, root: Path, eid: str, api: ApiSocket | None = None, grading: bool = False,
                        harness_prefix: Path | None = None):
        vols = (self._episode_volumes(root, None, workspace=False) if grading
                else self._instance_volumes(root, api, harness_prefix))
        return self._run(image, vols, WORKDIR, root, eid)

    async def _prepare_instance(self, task: Task, episode_id: str, upstream: str | None = None,
                                grading: bool = False, harness_prefix: Path | None = None) -> Sandbox:
        inst = task.swebench
        root = Path(tempfile.mkdtemp(prefix=f"polar-{episode_id}-", dir=self.workdir))
        api = None
        try:
            (root / "home").mkdir()
            image, how = await asyncio.to_thread(task_image, self.client, task, self.log)
            self.images[inst["instance_id"]] = (image, how)
            api = await ApiSocket(upstream).start() if upstream is not None else None
            container = await asyncio.to_thread(self._start_instance, image, root, episode_id, api, grading,
                                                harness_prefix)
            sandbox = self._sandbox(container, root, workspace=WORKDIR, node_dir=NODE_DIR, image=image)
            sandbox.image_path = image_path(how)  # official (its conda env) | built (Polar's venv)
            return await self._with_api(sandbox, api)
        except BaseException:
            await self._abandon(episode_id, api, root)
            raise

    async def _abandon(self, eid: str, api: ApiSocket | None, root: Path) -> None:
        """Undo a prepare that failed part way: containers.run leaves a created-but-failed container
        behind (found by its labels), the API socket and the episode directory."""
        await asyncio.to_thread(self._remove_episode, eid)
        if api is not None:
            await api.close()
        shutil.rmtree(root, ignore_errors=True)

    def _remove_episode(self, eid: str) -> None:
        for c in self.client.containers.list(all=True, filters={"label": [f"{LABEL}={self.run_label}",
                                                                          f"polar.episode={eid}"]}):
            _remove(c)

    def leftovers(self) -> list:
        return self.client.containers.list(all=True, filters={"label": f"{LABEL}={self.run_label}"})

    async def shutdown(self) -> None:
        for c in await asyncio.to_thread(self.leftovers):
            await asyncio.to_thread(_remove, c)
