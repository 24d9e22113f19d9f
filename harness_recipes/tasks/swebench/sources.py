"""The git repositories of Polar's bundled SWE-style instances, built deterministically from PyPI sdists.

An instance's ``polar_source`` (data/swebench/mini.jsonl):

    {"sdist": "sources/six-1.17.0.tar.gz", "sha256": "...", "url": "https://files.pythonhosted.org/...",
     "bug_patch": "bugs/six-ensure-text-errors.patch", "pythonpath": ""}

The repository: the sdist's files (its top directory stripped) committed by a fixed author at a
fixed date (that commit is the instance's ``environment_setup_commit``), then the planted bug
committed the same way (``base_commit``). Same bytes in, same commit ids out, on any machine: the
build checks the commit it made is the one the instance names. Built once into
$POLAR_CACHE/swebench/repos/<instance_id>/.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from harness_recipes.cache import polar_cache

DATE = "2000-01-01T00:00:00+0000"
IDENT = {"GIT_AUTHOR_NAME": "polar", "GIT_AUTHOR_EMAIL": "polar@localhost", "GIT_AUTHOR_DATE": DATE,
         "GIT_COMMITTER_NAME": "polar", "GIT_COMMITTER_EMAIL": "polar@localhost", "GIT_COMMITTER_DATE": DATE}


class SourceError(ValueError):
    pass


def _env() -> dict[str, str]:
    # No user or system git config (hooks, signing, autocrlf): they would change the commits.
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": "/dev/null", "GIT_TERMINAL_PROMPT": "0", "LANG": "C", **IDENT}


def git(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", *args], cwd=cwd,
                          env=_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SourceError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip()[-400:]}")
    return proc.stdout.strip()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _source(inst: dict, base: Path) -> tuple[dict, Path, Path]:
    src = inst["polar_source"]
    if not isinstance(src, dict):
        raise SourceError("must be an object {sdist, sha256, bug_patch, ...}")
    for key in ("sdist", "sha256", "bug_patch"):
        if not isinstance(src.get(key), str):
            raise SourceError(f"missing string field {key!r}")
    sdist, bug = (base / src["sdist"]).resolve(), (base / src["bug_patch"]).resolve()
    for p in (sdist, bug):
        if not p.is_file():
            raise SourceError(f"file not found: {p}")
    got = sha256(sdist)
    if got != src["sha256"]:
        raise SourceError(f"{sdist}: sha256 {got} is not the recorded {src['sha256']} (a different file)")
    return src, sdist, bug


def _extract(sdist: Path, dest: Path) -> None:
    with tarfile.open(sdist) as tar:
        members = tar.getmembers()
        top = {m.name.split("/", 1)[0] for m in members}
        if len(top) != 1:
            raise SourceError(f"{sdist}: expected one top directory, found {sorted(top)[:5]}")
        tar.extractall(dest, filter="data")
    (inner,) = [dest / t for t in top]
    for child in inner.iterdir():
        child.rename(dest / child.name)
    inner.rmdir()


def build_repo(inst: dict, base: Path, dest: Path) -> tuple[str, str]:
    """Build the repository into dest; returns (sdist commit, bug commit)."""
    src, sdist, bug = _source(inst, base)
    dest.mkdir(parents=True)
    _extract(sdist, dest)
    git(["init", "-q"], dest)
    git(["add", "-A", "-f", "."], dest)
    git(["commit", "-q", "-m", f"{Path(src['sdist']).name} as published on PyPI (sha256 {src['sha256']})"], dest)
    setup = git(["rev-parse", "HEAD"], dest)
    git(["apply", str(bug)], dest)
    git(["add", "-A", "-f", "."], dest)
    git(["commit", "-q", "-m", f"plant the bug of {inst['instance_id']}"], dest)
    return setup, git(["rev-parse", "HEAD"], dest)


def ensure_repo(inst: dict, base: Path) -> Path:
    """The instance's repository (built once into the cache); its commits checked against the instance."""
    _source(inst, base)  # the recorded sdist and bug patch, checked even when the build is cached
    root = polar_cache() / "swebench" / "repos"
    dest = root / inst["instance_id"]
    if (dest / ".git").is_dir():
        try:
            if git(["rev-parse", "HEAD"], dest) == inst["base_commit"]:
                return dest
        except SourceError:
            pass
        shutil.rmtree(dest)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{inst['instance_id']}-", dir=root))
    try:
        setup, head = build_repo(inst, base, tmp / "repo")
        if (setup, head) != (inst["environment_setup_commit"], inst["base_commit"]):
            raise SourceError(f"the repository built from the sdist has commits {setup} / {head}, not the "
                              f"instance's environment_setup_commit / base_commit {inst['environment_setup_commit']} "
                              f"/ {inst['base_commit']}")
        try:
            (tmp / "repo").rename(dest)
        except OSError:  # another process built it first
            if not (dest / ".git").is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def clone_bundle(bundle: Path) -> Path:
    """A git bundle (REPOS/owner__name.bundle) cloned once into $POLAR_CACHE/swebench/repos/, keyed by
    its sha256 (a changed bundle gets a fresh clone). The image build then fetches base_commit from it."""
    digest = sha256(bundle)[:16]
    dest = polar_cache("swebench", "repos", f"{bundle.stem}-{digest}")
    if (dest / ".git").is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{bundle.stem}-", dir=dest.parent))
    try:
        git(["clone", "-q", "--no-checkout", str(bundle.resolve()), str(tmp / "repo")], dest.parent)
        try:
            (tmp / "repo").rename(dest)
        except OSError:  # a concurrent clone won: use it
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if not (dest / ".git").is_dir():
        raise SourceError(f"cloning {bundle} did not give a repository at {dest}")
    return dest
