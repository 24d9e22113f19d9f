"""The wheels of an instance's test environment, downloaded from PyPI on the host, once.

The image build runs with no network (images.py), so pip inside it installs from a directory of
wheels that the host fetched with its own pip: the requirements, the pip_packages, the
repository's build backend (for the spec's `pip install -e .`), and pip itself (Debian's python3
has no ensurepip). Kept in $POLAR_CACHE/swebench/wheels/<key>/, keyed by the environment: a second
build of the same environment, on this machine or after a restart, downloads nothing.

The host's pip resolves for the image's Python: when the host runs another Python version, pip is
told the target (``--python-version``, binary wheels only).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness_recipes.cache import polar_cache

PLATFORM = "manylinux2014_x86_64"


class WheelError(RuntimeError):
    pass


def _target_args(python: str) -> list[str]:
    if python == f"{sys.version_info.major}.{sys.version_info.minor}":
        return []
    abi = "cp" + python.replace(".", "")
    return ["--python-version", python, "--only-binary=:all:", "--platform", PLATFORM, "--implementation", "cp",
            "--abi", abi]


def download_wheels(env) -> Path:
    dest = polar_cache("swebench", "wheels", env.key())
    if (dest / ".complete").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f"{env.key()}-", dir=dest.parent))
    pip = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(part),
           *_target_args(env.python)]
    steps = []
    if env.requirements.strip():
        (part / "requirements.txt").write_text(env.requirements)
        steps.append(pip + ["-r", str(part / "requirements.txt")])
    if env.pip_packages:
        steps.append(pip + env.pip_packages)
    steps.append(pip + ["pip", "setuptools", "wheel", *env.build_requires])
    for argv in steps:
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
        if proc.returncode != 0:
            raise WheelError(f"pip download failed ({' '.join(argv[5:])[:200]}): {proc.stderr.strip()[-1200:]}")
    (part / "requirements.txt").unlink(missing_ok=True)
    (part / ".complete").write_text("ok\n")
    try:
        part.rename(dest)
    except OSError:  # another process finished first: theirs is as good
        import shutil
        shutil.rmtree(part, ignore_errors=True)
    return dest
