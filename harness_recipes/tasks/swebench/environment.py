"""What an instance's test environment needs, and whether it can be built here.

The official harness builds a conda env from the spec (specs.py): `conda create python=X`, then the
spec's packages (a requirements file of the repository at environment_setup_commit, an
environment.yml, or a conda package list), pip_packages, then pre_install and install in the
repository. Polar builds the same from Debian packages and PyPI only (images.py): the Debian base's
Python, a venv, the requirements and pip_packages as wheels downloaded from PyPI on the host, the
install command run in the repository at base_commit with no network. Whatever that cannot give is
refused up front with the reason (`Refused`), never run into an eval_error:

- a Python version other than the one the Debian base ships (PYTHONS);
- an environment.yml or a conda package list (conda-only);
- pre_install commands that need the network (apt-get);
- a requirements file at environment_setup_commit that is not on this machine;
- no repository at base_commit on this machine;
- not a Python instance.

The requirements file is read as swebench reads it (get_requirements in 4.1.0: the first of the
repo's MAP_REPO_TO_REQS_PATHS that exists at environment_setup_commit, `-r` includes inlined first,
`-e .`, comments and `.[test` lines dropped, REPLACE_REQ_PACKAGES applied), from a local clone that
holds that commit, else from ``REPOS/requirements/<owner__name>/<commit>.txt`` (the resolved text,
for a clone that lacks the commit: how CI carries flask's).
"""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness_recipes.tasks.swebench.specs import SpecError, language, spec_for, tables

# Debian suite -> the Python its python3 is. The base image is bookworm (images.py).
PYTHONS = {"3.11": "bookworm"}
NETWORK_WORDS = ("apt-get", "apt ", "wget ", "curl ", "conda ", "git clone")


class Refused(ValueError):
    """The instance cannot be built here; the message says why."""


@dataclass
class Environment:
    python: str
    requirements: str  # the requirements text to pip install ("" for none)
    pip_packages: list[str] = field(default_factory=list)
    setup: list[str] = field(default_factory=list)  # MAP_REPO_TO_INSTALL, pre_install, install: in /testbed
    build_requires: list[str] = field(default_factory=list)  # the repository's build backend (offline install)

    def key(self) -> str:
        text = "\n".join([self.python, self.requirements, *self.pip_packages, "--", *self.setup, "--",
                          *self.build_requires])
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent", "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_CONFIG_GLOBAL": "/dev/null", "LANG": "C"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)


def has_commit(repo: Path | None, commit: str) -> bool:
    return repo is not None and _git(repo, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def _show(repo: Path, commit: str, path: str) -> str | None:
    p = _git(repo, "show", f"{commit}:{path}")
    return p.stdout if p.returncode == 0 else None


def requirements_from_clone(repo_name: str, repo: Path, commit: str) -> str | None:
    """swebench's get_requirements_by_commit, reading the clone instead of raw.githubusercontent.com."""
    paths = tables()["MAP_REPO_TO_REQS_PATHS"].get(repo_name, [])
    for req_path in paths:
        text = _show(repo, commit, req_path)
        if text is not None:
            break
    else:
        return None
    req_dir = "/".join(req_path.split("/")[:-1])

    def exclude(line: str) -> bool:
        return any(line.strip().startswith(x) for x in ("-e .", "#", ".[test"))

    original, additional = [], []
    for line in text.split("\n"):
        if line.strip().startswith("-r"):
            name = line[len("-r"):].strip()
            extra = _show(repo, commit, f"{req_dir}/{name}" if req_dir else name)
            if extra is not None:
                additional += [x for x in extra.split("\n") if not exclude(x)]
        elif not exclude(line):
            original.append(line)
    additional.append("\n".join(original))
    return clean_requirements("\n".join(additional))


def clean_requirements(text: str) -> str:
    for old, new in tables()["REPLACE_REQ_PACKAGES"]:
        if new is None:
            text = re.sub(rf"^{re.escape(old)}([<>=!~]=?.*|$)\n?", "", text, flags=re.MULTILINE)
        else:
            text = re.sub(rf"^{re.escape(old)}([<>=!~]=?.*|$)", new, text, flags=re.MULTILINE)
    return text


def saved_requirements(repos: Path | None, repo_name: str, commit: str) -> Path | None:
    if repos is None:
        return None
    p = Path(repos) / "requirements" / repo_name.replace("/", "__") / f"{commit}.txt"
    return p if p.is_file() else None


def build_requires(repo: Path, base_commit: str) -> list[str]:
    """The repository's PEP 517 build requirements at base_commit (pip needs them offline for the
    spec's `pip install -e .`); a setup.py project gets setuptools and wheel."""
    import tomllib
    text = _show(repo, base_commit, "pyproject.toml")
    reqs = []
    if text:
        try:
            reqs = list(tomllib.loads(text).get("build-system", {}).get("requires", []))
        except tomllib.TOMLDecodeError:
            reqs = []
    return reqs or ["setuptools>=40.8.0", "wheel"]


def spec_refusal(name: str, spec: dict) -> str:
    """Why an instance of this spec cannot be built here, whatever its repository ('' when it can)."""
    lang = language(name)
    if lang and lang != "py":
        return f"not a Python instance ({name} is {lang}): Polar builds Python environments only; use the official image"
    py = str(spec.get("python", ""))
    if py not in PYTHONS:
        return (f"needs Python {py}; the Debian base ({', '.join(PYTHONS.values())}) ships Python "
                f"{', '.join(PYTHONS)} only: use the official image")
    pkgs = spec.get("packages", "") or ""
    if pkgs == "environment.yml":
        return "installs a conda environment.yml (conda-only): use the official image"
    if pkgs and pkgs != "requirements.txt":
        return f"installs conda packages ({pkgs}) with conda create (conda-only): use the official image"
    repo_install = tables()["MAP_REPO_TO_INSTALL"].get(name)
    for cmd in ([repo_install] if repo_install else []) + list(spec.get("pre_install", [])):
        if any(w in cmd for w in NETWORK_WORDS):
            return f"its pre-install step needs the network or conda ({cmd!r}): use the official image"
    return ""


def environment(inst: dict, repo: Path | None, repos: Path | None) -> Environment:
    """The environment to build for an instance, or Refused with the reason."""
    name, version = inst["repo"], inst["version"]
    try:
        spec = spec_for(name, version)
    except SpecError as e:
        raise Refused(str(e)) from None
    why = spec_refusal(name, spec)
    if why:
        raise Refused(why)
    py, pkgs = str(spec["python"]), spec.get("packages", "") or ""
    repo_install = tables()["MAP_REPO_TO_INSTALL"].get(name)
    setup = ([repo_install] if repo_install else []) + list(spec.get("pre_install", []))
    if spec.get("install"):
        setup.append(spec["install"])
    if repo is None or not has_commit(repo, inst["base_commit"]):
        raise Refused(f"no local repository holding base_commit {inst['base_commit'][:12]} (give --repos DIR "
                      f"with {name.replace('/', '__')}, a clone or a .bundle)")
    reqs = ""
    if pkgs == "requirements.txt":
        commit = inst["environment_setup_commit"]
        if has_commit(repo, commit):
            reqs = requirements_from_clone(name, repo, commit)
            if reqs is None:
                raise Refused(f"none of {tables()['MAP_REPO_TO_REQS_PATHS'].get(name, [])} at "
                              f"environment_setup_commit {commit[:12]}")
        else:
            saved = saved_requirements(repos, name, commit)
            if saved is None:
                raise Refused(f"the requirements at environment_setup_commit {commit[:12]} are not on this "
                              f"machine: a clone in --repos holding that commit, or "
                              f"REPOS/requirements/{name.replace('/', '__')}/{commit}.txt")
            reqs = saved.read_text()
    return Environment(python=py, requirements=reqs, pip_packages=list(spec.get("pip_packages", [])), setup=setup,
                       build_requires=build_requires(repo, inst["base_commit"]))
