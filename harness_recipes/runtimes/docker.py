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
episode, saying so). No capabilities, no-new-privileges; /etc less its secrets. Limits: memory,
CPUs, pids. Cleanup: every container carries a per-run label; close() removes it (force), and
shutdown() sweeps any container of the run still there, whatever path the run left by.
"""
from __future__ import annotations

import asyncio
import io
import shutil
import subprocess
import tarfile
import tempfile
import time
import uuid
from pathlib import Path

from harness_recipes.docker_engine import docker_client
from harness_recipes.tasks.swebench.images import image_path, task_image
from harness_recipes.tasks.task_file import Task

from ..cache import install_prefix
from .api_socket import SANDBOX_DIR, ApiSocket
from .base import OUTPUT_CAP, ExecResult, Runtime, Sandbox, populate_workspace
from .file_tree import ObjectStore, Snapshot, snapshot_tar
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
                 image: str = ""):
        self.client, self.container, self.root = client, container, root
        self.workspace = workspace or str(root / "workspace")
        self.home = str(root / "home")
        self.image = image
        self.isolation = "docker"
        if node_dir:
            self.node_dir = node_dir  # the scheduler puts it first on the harness's PATH
        self._closed = False

    def _exec(self, argv: list[str], env: dict[str, str], timeout: float, cwd: str) -> ExecResult:
        import docker
        t0 = time.monotonic()
        # coreutils timeout runs the command in its own process group and kills the whole group.
        wrapped = ["timeout", "-k", "3", f"{timeout:.3f}", *argv]
        try:
            res = self.container.exec_run(wrapped, environment=env, workdir=cwd, demux=True)
        except docker.errors.APIError as e:
            raise ContainerGone(self._why_gone(e)) from None
        if res.exit_code is None or res.exit_code == 137 and time.monotonic() - t0 < timeout and self._dead():
            raise ContainerGone(self._why_gone(None))
        out, err = res.output if res.output else (b"", b"")
        seconds = time.monotonic() - t0
        timed_out = res.exit_code in (124, 137) and seconds >= timeout
        return ExecResult(rc=None if timed_out else res.exit_code, stdout=(out or b"")[:OUTPUT_CAP],
                          stderr=(err or b"")[:OUTPUT_CAP], timed_out=timed_out, seconds=seconds)

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
            # before docker reported the death.
            if self._dead():
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

    def __init__(self, network: str = "none", memory: str = "4g", cpus: float = 2.0, pids: int = 1024,
                 workdir: str | None = None, log=None):
        if network != "none":
            raise ValueError(f"docker network must be none, not {network!r}: a container reaches only its model "
                             "API, through the episode's Unix socket (no host network, no bridges)")
        self.network, self.memory, self.cpus, self.pids = network, memory, cpus, pids
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

    def _run(self, image: str, volumes, workdir: str, root: Path, eid: str):
        return self.client.containers.run(
            image, ["sleep", "infinity"], detach=True, network_mode="none",
            mem_limit=self.memory, nano_cpus=int(self.cpus * 1e9), pids_limit=self.pids,
            volumes=volumes, working_dir=workdir, init=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
            labels={LABEL: self.run_label, "polar.episode": eid}, tmpfs={"/tmp": "rw,size=512m"},
            environment={"HOME": str(root / "home")}, hostname="sandbox",
        )

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
            sandbox = DockerSandbox(self.client, container, root, image=self.image)
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
            sandbox = DockerSandbox(self.client, container, root, workspace=WORKDIR, node_dir=NODE_DIR, image=image)
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
