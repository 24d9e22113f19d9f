"""The wheels of an instance's test environment, resolved by pip inside the image's own Debian root, once.

The image build runs with no network (images.py), so pip inside it installs from a directory of
wheels made beforehand: the spec's conda packages (their PyPI equivalents), requirements and
pip_packages, the dependencies of what the spec's install installs from the repository (its
`.[test]`, ...), the repository's build backend, and pip itself. They are resolved and built by pip
running in the image's Debian root (the base tarball unpacked once into the cache, entered with
chroot): the target's own Python evaluates every marker and `Requires-Python` (a host pip resolving
for another Python drops conditional dependencies), and sdists become wheels there, with that
Python. Before resolving, pip itself is upgraded to PIP (the first with `--uploaded-prior-to`), and
every resolution is capped at the environment's `resolved_before`, so a rebuild gets the same
versions. The root reaches PyPI through the host's network, with the host's CA bundle.

Kept in $POLAR_CACHE/swebench/wheels/<key>/, keyed by the environment and base_commit (the
repository's dependencies are part of it): a second build on this machine downloads nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from harness_recipes.cache import polar_cache

# pip that resolves (not the one installed in the image: that one is resolved like the rest).
PIP = "26.0.1"
PIP_FIRST_PYTHON = (3, 9)  # pip 26 needs Python >= 3.9; older user interpreters get their newest pip
DRY_RUN_PYTHON = (3, 7)  # `pip install --dry-run --report` needs pip >= 22.2: Python >= 3.7
CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


class WheelError(RuntimeError):
    pass


def wheels_key(env, base_commit: str) -> str:
    return hashlib.sha256(f"{env.key()}|{base_commit}|{PIP}".encode()).hexdigest()[:12]


def _host_ca() -> Path | None:
    """The CA bundle the host's own pip trusts (a TLS-inspecting proxy's CA is only there)."""
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(var) and Path(os.environ[var]).is_file():
            return Path(os.environ[var])
    return next((Path(p) for p in CA_BUNDLES if Path(p).is_file()), None)


def _pip_wheel(python: str, dest: Path) -> Path:
    """pip itself, as a wheel for the target Python (pure Python, no dependencies)."""
    want = f"pip=={PIP}" if tuple(int(x) for x in python.split(".")) >= PIP_FIRST_PYTHON else "pip"
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                           "--only-binary=:all:", "--python-version", python, "-d", str(dest), want],
                          capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    found = sorted(dest.glob("pip-*.whl"))
    if proc.returncode != 0 or not found:
        raise WheelError(f"pip download {want} for Python {python} failed: {proc.stderr.strip()[-600:]}")
    return found[-1]


def _chroot(root: Path, script: str, env: dict[str, str], timeout: float = 3600) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "PIP_NO_INPUT": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_CACHE_DIR": "1"}
    # the host's proxy settings, if any, are how the root reaches PyPI too
    base.update({k: v for k, v in os.environ.items() if k.lower() in ("http_proxy", "https_proxy", "no_proxy")})
    exe = shutil.which("chroot") or next((p for p in ("/usr/sbin/chroot", "/sbin/chroot") if Path(p).is_file()), None)
    if exe is None:
        raise WheelError("resolving an instance's packages inside its Debian root needs chroot (coreutils)")
    return subprocess.run([exe, str(root), "/bin/sh", "-ec", script], capture_output=True, text=True,
                          env={**base, **env}, timeout=timeout)


def _user_python_in(root: Path, prefix: Path) -> None:
    """The user's CPython copied into the root at its own path (as in the image), once."""
    dest = root / str(prefix).lstrip("/")
    if (dest / ".polar-complete").is_file():
        return
    part = dest.with_name(dest.name + f".part-{os.getpid()}")
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(prefix, part, symlinks=True)
    (part / ".polar-complete").write_text(f"copied from {prefix}\n")
    shutil.rmtree(dest, ignore_errors=True)
    part.rename(dest)


def _dry_run_deps(report: Path) -> list[str]:
    """name==version of everything a `pip install --dry-run --report` would install, but the local project."""
    data = json.loads(report.read_text())
    out = []
    for item in data.get("install", []):
        url = (item.get("download_info") or {}).get("url", "")
        if url.startswith("file://"):
            continue  # the repository itself: installed from /testbed by the spec's install
        meta = item["metadata"]
        out.append(f"{meta['name']}=={meta['version']}")
    return out


def download_wheels(env, root: Path, testbed: Path, base_commit: str) -> Path:
    """The wheel directory for env, resolved in the Debian root `root` (debian_root in images.py),
    `testbed` the repository at base_commit (its install target's dependencies are resolved too)."""
    dest = polar_cache("swebench", "wheels", wheels_key(env, base_commit))
    if (dest / ".complete").is_file():
        return dest
    if os.geteuid() != 0:
        raise WheelError("resolving an instance's packages inside its Debian root needs root (chroot)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="polar-wheels-", dir=root / "tmp"))
    inside = "/" + str(work.relative_to(root))
    try:
        (work / "wheels").mkdir()
        # the root resolves names as the host does now (only this step reaches the network)
        if Path("/etc/resolv.conf").is_file():
            conf = root / "etc" / "resolv.conf"
            if conf.is_symlink():  # never write through a link of the root's into the host's files
                conf.unlink()
            shutil.copy("/etc/resolv.conf", conf)
        pip_whl = _pip_wheel(env.python, work)
        ca = _host_ca()
        extra = {}
        if ca is not None:
            shutil.copy(ca, work / "ca.crt")
            extra["PIP_CERT"] = f"{inside}/ca.crt"
        python = env.executable
        if env.user_python:
            _user_python_in(root, Path(env.user_python))
        shutil.copytree(testbed, work / "testbed", symlinks=True)
        cap = f"--uploaded-prior-to {env.resolved_before}" if env.resolved_before else ""
        venv = f"{inside}/venv"
        wheel = f"{venv}/bin/python -m pip wheel -q {cap} -w {inside}/wheels"
        groups = []
        if env.conda:
            (work / "conda.txt").write_text("\n".join(env.conda) + "\n")
            groups.append(f"{wheel} -r {inside}/conda.txt")
        if env.requirements.strip():
            (work / "requirements.txt").write_text(env.requirements)
            groups.append(f"{wheel} -r {inside}/requirements.txt")
        if env.pip_packages:
            (work / "pip_packages.txt").write_text("\n".join(env.pip_packages) + "\n")
            groups.append(f"{wheel} -r {inside}/pip_packages.txt")
        (work / "tools.txt").write_text("\n".join(["pip", "setuptools", "wheel", *env.build_requires]) + "\n")
        groups.append(f"{wheel} -r {inside}/tools.txt")
        # the spec's pre_install edits (sed of setup.py pins, ...) change what the install resolves to
        pre = env.setup[:-1] if env.installs else list(env.setup)
        target = env.install_target.replace(".", f"{inside}/testbed", 1)
        if tuple(int(x) for x in env.python.split(".")) >= DRY_RUN_PYTHON:
            resolve_target = (f"{venv}/bin/python -m pip install -q --dry-run --ignore-installed {cap} "
                              f"--report {inside}/report.json '{target}'")
        else:  # that Python's newest pip has no --dry-run: its wheel (harmless beside /testbed) comes along
            resolve_target = f"{wheel} '{target}'"
        script = "\n".join([
            f"{python} -m venv --without-pip {venv}",
            # pip upgraded first: the one in the wheel installs the pinned resolver, then resolution
            f"{venv}/bin/python {inside}/{pip_whl.name}/pip install -q --no-index {inside}/{pip_whl.name}",
            *groups,
            f"cd {inside}/testbed",
            *[f"( . {venv}/bin/activate && {c} )" for c in pre],
            resolve_target,
        ])
        proc = _chroot(root, script, extra)
        if proc.returncode != 0:
            raise WheelError(f"resolving in the Debian {env.suite} root failed: "
                             f"{(proc.stdout + proc.stderr).strip()[-1500:]}")
        deps = _dry_run_deps(work / "report.json") if (work / "report.json").is_file() else []
        if deps:
            (work / "target.txt").write_text("\n".join(deps) + "\n")
            proc = _chroot(root, f"{wheel} --no-deps -r {inside}/target.txt", extra)
            if proc.returncode != 0:
                raise WheelError(f"building the install target's wheels failed: {proc.stderr.strip()[-1500:]}")
        part = Path(tempfile.mkdtemp(prefix=f"{dest.name}-", dir=dest.parent))
        for whl in (work / "wheels").iterdir():
            shutil.move(str(whl), part / whl.name)
        (part / "resolved.txt").write_text("\n".join(sorted(p.name for p in part.glob("*.whl"))) + "\n")
        (part / ".complete").write_text(f"resolved before {env.resolved_before or '(uncapped)'} by pip {PIP} "
                                        f"in Debian {env.suite}\n")
        try:
            part.rename(dest)
        except OSError:  # another process finished first: theirs is as good
            shutil.rmtree(part, ignore_errors=True)
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)
