"""SWE-bench's per-repo/version specs: how an official row is installed and tested.

An official SWE-bench row (Verified, Lite, full) names only `repo` and `version`; swebench's
MAP_REPO_VERSION_TO_SPECS says the rest: the Python version, the packages (a requirements file of
the repository, an environment.yml, or a conda package list), pip_packages, pre_install and
install commands, the test command. swebench 5 dropped that map from the package. So:

1. the installed swebench's map, where the installed release ships one (swebench < 5);
2. else the copy in specs_data/ (taken from swebench 4.1.0 on PyPI by specs_import.py, with the
   wheel's and each file's sha256 and the MIT licence beside it).

`source()` says which, so a record can tell.
"""
from __future__ import annotations

import functools
import json
from importlib.resources import files

VENDORED = files("harness_recipes.tasks.swebench") / "specs_data" / "swebench-4.1.0.json"


class SpecError(LookupError):
    pass


@functools.lru_cache(maxsize=1)
def tables() -> dict:
    """The spec tables: MAP_REPO_VERSION_TO_SPECS and the maps the official script builders read."""
    try:
        from swebench.harness import constants as c
        installed = getattr(c, "MAP_REPO_VERSION_TO_SPECS", None)
    except ImportError:
        installed = None
    if installed:
        import swebench
        t = {k: getattr(c, k) for k in ("MAP_REPO_VERSION_TO_SPECS", "MAP_REPO_TO_REQS_PATHS",
                                        "MAP_REPO_TO_ENV_YML_PATHS", "MAP_REPO_TO_INSTALL", "MAP_REPO_TO_EXT",
                                        "NON_TEST_EXTS", "START_TEST_OUTPUT", "END_TEST_OUTPUT")}
        t["REPLACE_REQ_PACKAGES"] = [("types-pkg_resources", "types-setuptools")]
        t["provenance"] = {"package": "swebench", "version": swebench.__version__, "installed": True}
        return t
    return json.loads(VENDORED.read_text())


def source() -> str:
    p = tables()["provenance"]
    where = "installed package" if p.get("installed") else f"copy in {VENDORED.name}, sha256 of wheel {p['wheel_sha256'][:12]}"
    return f"swebench {p['version']} ({where})"


def spec_for(repo: str, version: str) -> dict:
    """The spec of one repo and version, or SpecError saying what is missing."""
    specs = tables()["MAP_REPO_VERSION_TO_SPECS"]
    if repo not in specs:
        raise SpecError(f"no SWE-bench spec for repo {repo!r} in {source()}")
    if version not in specs[repo]:
        raise SpecError(f"no SWE-bench spec for {repo} version {version!r} in {source()} "
                        f"(it has {', '.join(sorted(specs[repo]))})")
    return specs[repo][version]


def language(repo: str) -> str:
    return tables()["MAP_REPO_TO_EXT"].get(repo, "")
