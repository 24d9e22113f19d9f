"""What an instance's test environment needs, and whether it can be built here.

The official harness builds a conda env from the spec (specs.py): `conda create python=X`, then the
spec's packages (a requirements file of the repository at environment_setup_commit, an
environment.yml, or a conda package list), pip_packages, then pre_install and install in the
repository. Polar builds the same from the Debian archive and PyPI only (images.py, wheels.py): a
Debian suite's Python (pythons.py: bullseye's 3.9, bookworm's 3.11) or a relocatable CPython the
user gives (`--python X.Y=DIR`), a venv, the packages as wheels that pip resolved inside that
Debian root as of RESOLVED_BEFORE, the install command run in the repository at base_commit with
no network. Whatever that cannot give is refused up front with the reason (`Refused`), never run
into an eval_error:

- a Python version that neither Debian nor the user gives (pythons.missing);
- an environment.yml, or a conda package list with no faithful PyPI equivalent (conda_packages.py:
  a list that has one, e.g. `pytest` or `mpmath flake8`, is installed from PyPI and the plan says so);
- pre_install commands that need the network (apt-get);
- a requirements file at environment_setup_commit that is not on this machine;
- no repository at base_commit on this machine;
- not a Python instance.

The requirements file is read as swebench reads it (get_requirements in 4.1.0: the first of the
repo's MAP_REPO_TO_REQS_PATHS that exists at environment_setup_commit, `-r` includes inlined first,
`-e .`, comments and `.[test` lines dropped, REPLACE_REQ_PACKAGES applied), from a local clone that
holds that commit, else from ``REPOS/requirements/<owner__name>/<commit>.txt`` (the resolved text,
for a clone that lacks the commit: how CI carries flask's and pylint's).
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness_recipes.tasks.swebench.conda_packages import CondaRefusal, pypi_equivalent
from harness_recipes.tasks.swebench.pythons import DEBIAN, interpreter, missing
from harness_recipes.tasks.swebench.specs import SpecError, language, spec_for, tables

# Python version -> the Debian suite whose python3 it is (that suite is the image's base).
PYTHONS = DEBIAN
# Package resolution is capped by date, so a rebuild resolves the same versions (pip's
# --uploaded-prior-to, pip >= 26.0, hence Python >= 3.9; older user interpreters resolve uncapped and
# the plan says so). The official images resolved as of their own build dates, which are not
# published per image; 2025-01-01 is after every Verified row's environment_setup_commit.
RESOLVED_BEFORE = "2025-01-01T00:00:00Z"
CAPPED_FROM = (3, 9)
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
    suite: str = "bookworm"  # the Debian base
    executable: str = "python3"  # the interpreter in the image that makes the venv
    user_python: str = ""  # a user's CPython build (copied into the image), "" for Debian's
    conda: list[str] = field(default_factory=list)  # the spec's conda packages, as their PyPI equivalents
    conda_decision: str = ""  # how the conda package list was mapped, in words ("" without one)
    resolved_before: str = ""  # the date cap of the resolution ("" when the interpreter's pip has none)
    install_target: str = "."  # what the spec's install installs from /testbed (its extras), resolved too
    installs: bool = False  # setup ends with the spec's install command (the steps before it are pre-install)
    # The test command runs `tox --current-env`, which calls the env's python through a symlink of its
    # own: a conda env's python finds its packages from any path, a venv's only from its bin/, so the
    # image's base interpreter is made to see the venv's packages too (images.dockerfile)
    current_env: bool = False

    def key(self) -> str:
        text = "\n".join([self.python, self.requirements, *self.pip_packages, "--", *self.setup, "--",
                          *self.build_requires, "--", self.suite, self.executable, self.user_python, *self.conda,
                          self.resolved_before, self.install_target])  # (installs follows from setup)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def describe(self) -> str:
        """The environment in one line (the plan's reason for a buildable instance)."""
        n = len([x for x in self.requirements.splitlines() if x.strip() and not x.strip().startswith("#")])
        interp = interpreter(self.python, {self.python: self.user_python} if self.user_python else None)
        cap = (f"resolved as of {self.resolved_before}" if self.resolved_before
               else "resolved without a date cap (this Python's pip has no --uploaded-prior-to)")
        conda = f"{self.conda_decision}, " if self.conda_decision else ""
        return (f"{interp.describe()}, {conda}{n} requirements, {len(self.pip_packages)} pip_packages, {cap}, "
                f"install: {self.setup[-1] if self.setup else 'none'}")


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


def install_target(install: str) -> str:
    """What the spec's install command installs from the repository: `.`, `.[test]`, ... (`.` for a
    `setup.py install`): its dependencies are resolved with the rest, so the offline install finds them."""
    try:
        argv = shlex.split(install or "")
    except ValueError:
        return "."
    if "install" in argv and "pip" in argv:
        for a in argv[argv.index("install") + 1:]:
            if a.startswith("."):
                return a
    return "."


def spec_refusal(name: str, spec: dict, pythons: dict[str, str] | None = None) -> str:
    """Why an instance of this spec cannot be built here, whatever its repository ('' when it can).
    pythons: the user's interpreters ({"3.6": DIR}, `--python`)."""
    lang = language(name)
    if lang and lang != "py":
        return f"not a Python instance ({name} is {lang}): Polar builds Python environments only; use the official image"
    py = str(spec.get("python", ""))
    if interpreter(py, pythons) is None:
        return missing(py)
    pkgs = spec.get("packages", "") or ""
    if pkgs == "environment.yml":
        return "installs a conda environment.yml (conda-only): use the official image"
    if pkgs and pkgs != "requirements.txt":
        try:
            pypi_equivalent(pkgs, py)
        except CondaRefusal as e:
            return f"{e}: use the official image"
    repo_install = tables()["MAP_REPO_TO_INSTALL"].get(name)
    for cmd in ([repo_install] if repo_install else []) + list(spec.get("pre_install", [])):
        if any(w in cmd for w in NETWORK_WORDS):
            return f"its pre-install step needs the network or conda ({cmd!r}): use the official image"
    return ""


def environment(inst: dict, repo: Path | None, repos: Path | None) -> Environment:
    """The environment to build for an instance, or Refused with the reason. The user's interpreters
    travel in the row as `polar_pythons` ({"3.6": DIR}: `--python`, load_instances)."""
    name, version = inst["repo"], inst["version"]
    try:
        spec = spec_for(name, version)
    except SpecError as e:
        raise Refused(str(e)) from None
    pythons = inst.get("polar_pythons") or None
    why = spec_refusal(name, spec, pythons)
    if why:
        raise Refused(why)
    py, pkgs = str(spec["python"]), spec.get("packages", "") or ""
    interp = interpreter(py, pythons)
    conda, conda_decision = [], ""
    if pkgs and pkgs not in ("requirements.txt", "environment.yml"):
        conda, conda_decision = pypi_equivalent(pkgs, py)
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
    capped = tuple(int(x) for x in py.split(".")) >= CAPPED_FROM
    return Environment(python=py, requirements=reqs, pip_packages=list(spec.get("pip_packages", [])), setup=setup,
                       build_requires=build_requires(repo, inst["base_commit"]), suite=interp.suite,
                       executable=interp.executable, user_python=str(interp.source or ""), conda=conda,
                       conda_decision=conda_decision, resolved_before=RESOLVED_BEFORE if capped else "",
                       install_target=install_target(spec.get("install", "")), installs=bool(spec.get("install")),
                       current_env="--current-env" in str(spec.get("test_cmd", "")))
