"""Per-instance docker images for SWE-bench tasks: the official one when present, else built here.

The task resolves its image here (`task_image`), the docker runtime runs it.

Order, per instance (`instance_image`; `find_official` alone for the planner):
1. the instance's ``image`` field, if docker has that image locally;
2. the official image under either of its names, if docker has it locally (Polar never pulls):
   swebench's local-build name ``sweb.eval.x86_64.<instance_id>:latest`` (`make_image_spec(...).name`)
   or the registry's ``swebench/sweb.eval.x86_64.<owner>_1776_<repo>-<n>:latest`` (what
   `docker pull` of the published images leaves). Those run as the official harness runs them:
   the conda env /opt/miniconda3/envs/testbed activated by the eval script (eval_script.py);
3. else Polar builds ``polar-sweb.eval.<instance_id>:<key>`` (key: a hash of everything it is made of):
   - the base: a real Debian root made by `debootstrap --variant=minbase` from the Debian archive
     (SUITE_PACKAGES), `docker import`ed as ``polar-swebench-base:<key>`` (bookworm) or
     ``polar-swebench-<suite>:<key>``. The suite is the one whose python3 is the spec's Python
     (pythons.py: bullseye 3.9, bookworm 3.11; a user's interpreter goes onto bookworm). Its tarball
     is kept in $POLAR_CACHE/swebench/ so a machine (CI) runs debootstrap once per suite, and unpacked
     once there (debian_root) for pip to resolve in;
   - an official row (no eval_script of its own): its test environment from the spec
     (environment.py): a venv of that Python at eval_script.VENV, the conda list's PyPI equivalent,
     the requirements and pip_packages installed from wheels that pip resolved inside the Debian
     root, capped by date (wheels.py, kept in $POLAR_CACHE/swebench/wheels/), the spec's
     pre_install and install run in /testbed. The build itself runs with ``--network none``: pip
     reads only the wheels in the image (PIP_NO_INDEX), which stay there so the eval script's
     re-install works offline too;
   - Polar's bundled instances (and rows with their own test_cmd): the bookworm base as is (python3,
     pytest from Debian), their eval_script;
   - either way /testbed is the repository at base_commit, its .git holding base_commit and its
     ancestors only (base_only_repo): a fresh repository that fetched base_commit alone (and the
     release tags among its ancestors), so no later commit (the gold fix) is in the image on any
     ref, reflog or as a stray object.

Builds of one image run once per process (a lock per tag), whichever episode asks first: the
scheduler's prewarm phase asks while earlier episodes run, so the next image builds in parallel.
"""
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from harness_recipes.cache import polar_cache

SUITE = "bookworm"  # the base of Polar's bundled instances and of Python 3.11 specs
MIRROR = "http://deb.debian.org/debian"
# The headers and a C compiler in every base: pip builds the sdists that have no Linux wheel in the
# root (django's pywatchman), as swebench's own images can (their base installs build-essential).
TOOLCHAIN = ("python3-dev", "gcc", "libc6-dev")
# python3-coverage: termcolor's pytest configuration names a coverage warning class.
BASE_PACKAGES = ("python3", "python3-pytest", "python3-coverage", *TOOLCHAIN, "git", "ca-certificates", "patch")
# Per Debian suite (pythons.DEBIAN says which Python each has): bullseye for Python 3.9, with the
# venv module and distutils (old setup.py installs import it).
SUITE_PACKAGES = {
    "bookworm": BASE_PACKAGES,
    "bullseye": ("python3", "python3-venv", "python3-distutils", *TOOLCHAIN, "git", "ca-certificates", "patch"),
}
BASE_VERSION = 1  # bump when the base's recipe changes in a way its key does not show
WORKDIR = "/testbed"
# 2: /testbed holds base_commit and its ancestors only (base_only_repo); 1 held every ref of the clone.
TESTBED_VERSION = 2


class ImageError(RuntimeError):
    pass


def base_key(suite: str = SUITE) -> str:
    spec = f"{BASE_VERSION}|{suite}|{MIRROR}|minbase|{','.join(SUITE_PACKAGES[suite])}"
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def base_tag(suite: str = SUITE) -> str:
    # bookworm's tag is what it was before there were other suites (its images keep their names)
    return f"polar-swebench-base:{base_key(suite)}" if suite == SUITE else f"polar-swebench-{suite}:{base_key(suite)}"


def official_name(inst: dict) -> str:
    """swebench's own name for the instance image (its ImageSpec.name; no namespace: local)."""
    from swebench.image_builder.image_spec import make_image_spec
    return make_image_spec(inst, dockerfile="# the official image, built by swebench").name


def registry_name(inst: dict) -> str:
    """The published image's name on Docker Hub (`docker pull` leaves it under this name)."""
    return f"swebench/sweb.eval.x86_64.{inst['instance_id'].lower().replace('__', '_1776_')}:latest"


def official_candidates(inst: dict) -> list[str]:
    """The names an official image of the instance may have locally, the row's own first."""
    names = [inst["image"]] if inst.get("image") else []
    return names + [n for n in (official_name(inst), registry_name(inst)) if n not in names]


def find_official(client, inst: dict) -> tuple[str, str] | None:
    """(image, 'instance' | 'official') when the local engine has an official image of the instance."""
    for i, name in enumerate(official_candidates(inst)):
        if _exists(client, name):
            return name, "instance" if inst.get("image") and i == 0 else "official"
    return None


def uses_spec(inst: dict) -> bool:
    """An official row as published: its image is built from its spec (eval_script.spec_based)."""
    from harness_recipes.tasks.swebench.eval_script import spec_based
    return spec_based(inst)


def polar_name(inst: dict, env=None) -> str:
    iid = inst["instance_id"].lower().replace("__", "_1776_")
    # The tag changes with anything the image is made of: the base, the commit, the Dockerfile, the env.
    env_key = env.key() if env is not None else "-"
    base = base_tag(env.suite if env is not None else SUITE)
    key = hashlib.sha256(f"{base}|{inst['base_commit']}|{dockerfile(base, env)}|{TESTBED_VERSION}|"
                         f"{env_key}".encode()).hexdigest()[:12]
    return f"polar-sweb.eval.{iid}:{key}"


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(tag: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(tag, threading.Lock())


def _exists(client, tag: str) -> bool:
    import docker
    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def image_path(how: str) -> str:
    """'official' (an official image, its conda env) or 'built' (built here) from instance_image's how."""
    return "official" if how in ("instance", "official") else "built"


def instance_image(client, inst: dict, repo: Path | None, log=lambda m: None, repos: Path | None = None,
                   ) -> tuple[str, str]:
    """(image tag, how it was found: 'instance' | 'official' | 'built' | 'cached') for an instance."""
    found = find_official(client, inst)
    if found is not None:
        return found
    env = None
    if uses_spec(inst):
        from harness_recipes.tasks.swebench.environment import Refused, environment
        try:
            env = environment(inst, repo, repos)
        except Refused as e:
            raise ImageError(f"{inst['instance_id']}: no official image ({', '.join(official_candidates(inst))}) "
                             f"in the local docker, and it cannot be built here: {e}") from None
    tag = polar_name(inst, env)
    with _lock(tag):
        if _exists(client, tag):
            return tag, "cached"
        if repo is None:
            raise ImageError(f"{inst['instance_id']}: no image {official_name(inst)} in the local docker, and no "
                             "local repository to build one from (give --repos DIR, or build the official images "
                             "with the swebench package)")
        base = ensure_base(client, log, env.suite if env is not None else SUITE)
        build_instance(client, inst, repo, base, tag, env, log=log)
    return tag, "built"


def task_image(client, task, log=lambda m: None) -> tuple[str, str]:
    """instance_image for a SWE-bench task (task.swebench, its repository task.git_repo, the row's
    polar_repos): what the docker runtime runs. Any failure is an ImageError naming the instance."""
    inst = task.swebench
    repos = Path(inst["polar_repos"]) if inst.get("polar_repos") else None
    try:
        return instance_image(client, inst, task.git_repo, log, repos)
    except ImageError:
        raise
    except Exception as e:  # docker API errors while building or importing
        raise ImageError(f"{inst['instance_id']}: image build failed: {type(e).__name__}: {e}") from None


def dockerfile(base: str, env=None) -> str:
    lines = [f"FROM {base}"]
    if env is not None:
        from harness_recipes.tasks.swebench.eval_script import VENV
        act = f". {VENV}/bin/activate"
        if env.user_python:
            # the user's CPython at its own path (pythons.py): a build with an absolute rpath runs too
            lines.append(f"COPY python {env.user_python}")
        lines += [
            "COPY wheels /opt/polar/wheels",
            "COPY requirements.txt /opt/polar/requirements.txt",
            # offline: pip reads the wheels in the image only, now and in the eval script's re-install
            "ENV PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/polar/wheels PIP_DISABLE_PIP_VERSION_CHECK=1 "
            "PIP_NO_CACHE_DIR=1",
            # Debian's python3 may lack ensurepip (python3-venv): pip comes from its wheel
            f"RUN {env.executable} -m venv --without-pip {VENV} && {VENV}/bin/python /opt/polar/wheels/$(cd "
            "/opt/polar/wheels && ls pip-*.whl | head -1)/pip install -q pip",
        ]
        if env.current_env:
            # tox --current-env links .tox/*/bin/python to the venv's python, which then starts as the
            # base interpreter: a .pth of the base's adds the venv's packages (as a conda env's python has)
            site = f"{VENV}/lib/python{env.python}/site-packages"
            lines.append(f"RUN {env.executable} -c \"import os, site; d = site.getsitepackages()[0]; "
                         f"os.makedirs(d, exist_ok=True); open(os.path.join(d, 'polar-testbed-env.pth'), 'w')"
                         f".write('import site; site.addsitedir(%r)' % '{site}' + chr(10))\"")
        if env.conda:
            # the spec's conda package list, from PyPI (conda_packages.py), first as conda create has it
            lines.append(f"RUN {act} && python -m pip install -q {' '.join(shlex.quote(p) for p in env.conda)}")
        if env.requirements.strip():
            lines.append(f"RUN {act} && python -m pip install -q -r /opt/polar/requirements.txt")
        if env.pip_packages:
            lines.append(f"RUN {act} && python -m pip install -q {' '.join(shlex.quote(p) for p in env.pip_packages)}")
    lines += [f"COPY testbed {WORKDIR}",
              # the repository is root's in the image but the tests may run as another uid: trust it
              f"RUN git config --system --add safe.directory {WORKDIR} && git -C {WORKDIR} status --short | head -5",
              f"WORKDIR {WORKDIR}"]
    if env is not None:
        from harness_recipes.tasks.swebench.eval_script import VENV
        lines.append(f"ENV VIRTUAL_ENV={VENV} PATH={VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
                     "/sbin:/bin")
        lines += [f"RUN . {VENV}/bin/activate && {cmd}" for cmd in env.setup]
        # what the install step left in the tree is part of the pristine tree, as in the official images
        lines.append(f"RUN git -C {WORKDIR} status --short | head -5")
    return "\n".join(lines + [""])


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0", "LANG": "C"}
    return subprocess.run(["git", "-c", "advice.detachedHead=false", *args], cwd=cwd, env=env, capture_output=True,
                          text=True)


def base_only_repo(repo: Path, base_commit: str, dest: Path) -> None:
    """dest: a new repository holding base_commit and its ancestors only, checked out on branch
    `main`. Later commits (the gold fix, the test patch) are never fetched: no ref, reflog, tag,
    remote, FETCH_HEAD or loose object can lead the agent to them."""
    dest.mkdir(parents=True)
    # Release tags that base_commit reaches come along (setuptools_scm's `git describe` needs one);
    # they are its ancestors, so nothing later travels with them.
    tags = _git(["for-each-ref", "--format=%(refname)", "--merged", base_commit, "refs/tags"], Path(repo)).stdout.split()
    steps = [["init", "-q", "-b", "main"],
             # only what base_commit reaches travels (a pack of exactly those objects); a shallow source
             # (data/swebench-verified's depth-1 repositories) gives a shallow /testbed
             ["-c", "protocol.file.allow=always", "fetch", "-q", "--no-tags", "--update-shallow", "--upload-pack",
              "git -c uploadpack.allowAnySHA1InWant=true upload-pack", str(Path(repo).resolve()), base_commit,
              *[f"{t}:{t}" for t in tags]],
             ["update-ref", "refs/heads/main", base_commit],
             ["checkout", "-q", "-f", "main"],
             ["reflog", "expire", "--expire=now", "--all"],
             ["gc", "-q", "--prune=now"]]
    for args in steps:
        proc = _git(args, dest)
        if proc.returncode != 0:
            raise ImageError(f"cannot check out base_commit {base_commit} of {repo}: git {args[0]}: "
                             f"{proc.stderr.strip()[-300:]}")
    (dest / ".git" / "FETCH_HEAD").unlink(missing_ok=True)
    later = history_after(dest, base_commit)
    if later:
        raise ImageError(f"the repository for the image still reaches commits after {base_commit}: {later[:3]}")


def history_after(repo: Path, base_commit: str) -> list[str]:
    """Commits in repo that are not base_commit or its ancestors: on any ref, or unreachable but stored."""
    every = set(_git(["rev-list", "--all", "--reflog"], repo).stdout.split())
    ancestry = set(_git(["rev-list", base_commit], repo).stdout.split())
    dangling = _git(["fsck", "--unreachable", "--no-reflogs", "--no-progress"], repo).stdout.split("\n")
    loose = {line.split()[-1] for line in dangling if line.startswith("unreachable commit")}
    return sorted((every - ancestry) | loose)


def build_instance(client, inst: dict, repo: Path, base: str, tag: str, env=None, wheels: Path | None = None,
                   log=lambda m: None) -> None:
    """Build the image `tag`: /testbed at base_commit and, for an official row, its environment from
    wheels (given, or resolved now in the Debian root of the environment's suite: wheels.py)."""
    import docker
    with tempfile.TemporaryDirectory(prefix="polar-image-") as ctx:
        try:
            base_only_repo(repo, inst["base_commit"], Path(ctx) / "testbed")
        except ImageError as e:
            raise ImageError(f"{inst['instance_id']}: image build failed: {e}") from None
        if env is not None:
            if wheels is None:
                from harness_recipes.tasks.swebench.wheels import WheelError, download_wheels
                log(f"{inst['instance_id']}: resolving its environment with pip in the Debian {env.suite} root "
                    f"(as of {env.resolved_before or 'now'}; kept in the cache)")
                try:
                    wheels = download_wheels(env, debian_root(env.suite, log), Path(ctx) / "testbed",
                                             inst["base_commit"])
                except WheelError as e:
                    raise ImageError(f"{inst['instance_id']}: image build failed: {e}") from None
            shutil.copytree(wheels, Path(ctx) / "wheels")
            (Path(ctx) / "requirements.txt").write_text(env.requirements)
            if env.user_python:
                shutil.copytree(env.user_python, Path(ctx) / "python", symlinks=True)
        (Path(ctx) / "Dockerfile").write_text(dockerfile(base, env))
        try:
            client.images.build(path=ctx, tag=tag, network_mode="none", rm=True, forcerm=True,
                                labels={"polar.swebench.instance": inst["instance_id"]})
        except docker.errors.BuildError as e:
            tail = "".join(str(x.get("stream", x.get("error", ""))) for x in list(e.build_log)[-20:])
            raise ImageError(f"{inst['instance_id']}: image build failed: {e.msg}\n{tail[-1500:]}") from None


def base_tarball(suite: str = SUITE) -> Path:
    return polar_cache("swebench", f"debian-{suite}-minbase-{base_key(suite)}.tar.gz")


def _tarball(suite: str, log) -> Path:
    tarball = base_tarball(suite)
    with _lock(str(tarball)):
        if not tarball.is_file():
            log(f"building the Debian base ({suite}, minbase + {', '.join(SUITE_PACKAGES[suite])}) with "
                f"debootstrap: a minute or more, once; kept in {tarball}")
            make_base_tarball(tarball, suite)
    return tarball


def debian_root(suite: str = SUITE, log=lambda m: None) -> Path:
    """The base tarball unpacked once into the cache: the root pip resolves in (wheels.py, via chroot)."""
    root = polar_cache("swebench", "roots", f"{suite}-{base_key(suite)}")
    with _lock(str(root)):
        if (root / "etc" / "debian_version").is_file():
            return root
        tarball = _tarball(suite, log)
        root.parent.mkdir(parents=True, exist_ok=True)
        part = Path(tempfile.mkdtemp(prefix=f"{root.name}-", dir=root.parent))
        proc = subprocess.run(["tar", "--numeric-owner", "-xzf", str(tarball), "-C", str(part)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            shutil.rmtree(part, ignore_errors=True)
            raise ImageError(f"unpacking {tarball} failed: {proc.stderr[-500:]}")
        try:
            part.rename(root)
        except OSError:  # another process unpacked it first
            shutil.rmtree(part, ignore_errors=True)
    return root


def ensure_base(client, log=lambda m: None, suite: str = SUITE) -> str:
    tag = base_tag(suite)
    with _lock(tag):
        if _exists(client, tag):
            return tag
        tarball = _tarball(suite, log)
        log(f"docker import {tarball} {tag}")
        repo, t = tag.split(":")
        with open(tarball, "rb") as f:
            client.api.import_image_from_data(f, repository=repo, tag=t)
        if not _exists(client, tag):
            raise ImageError(f"docker import of {tarball} did not create {tag}")
    return tag


def make_base_tarball(dest: Path, suite: str = SUITE) -> None:
    exe = shutil.which("debootstrap") or ("/usr/sbin/debootstrap" if Path("/usr/sbin/debootstrap").exists() else None)
    if exe is None:
        raise ImageError("building the SWE-bench base image needs debootstrap (apt-get install -y debootstrap), "
                         "or the official instance images in the local docker")
    if os.geteuid() != 0:
        raise ImageError("debootstrap needs root to build the SWE-bench base image (or pre-build the official "
                         "instance images with the swebench package)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="polar-debootstrap-", dir=dest.parent) as tmp:
        root = Path(tmp) / "root"
        proc = subprocess.run([exe, "--variant=minbase", f"--include={','.join(SUITE_PACKAGES[suite])}", suite,
                               str(root), MIRROR], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageError(f"debootstrap failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-1500:]}")
        # Downloaded .debs and package lists: half the size, no use in a test image.
        for d in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (root / d).glob("*"):
                if p.is_file():
                    p.unlink()
        part = Path(tmp) / "base.tar.gz"
        proc = subprocess.run(f"tar --numeric-owner -C {root} -cf - . | gzip -1 > {part}", shell=True,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise ImageError(f"packing the Debian root failed: {proc.stderr[-500:]}")
        part.rename(dest)
