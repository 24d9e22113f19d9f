"""Conda-only specs: a spec's conda package list, installed from PyPI where that is the same thing.

Some of swebench's specs install packages with `conda create -n testbed python=X <packages>` (a
conda package list in the spec's `packages`). There is no conda channel here. A conda package whose
PyPI project is the same project (same name, built from the same source release) installs the
same code from PyPI; a pin that PyPI cannot give for the spec's Python (no wheel for it: conda-forge
built one, a source build here would be a different build) is refused. Each spec's decision is a
sentence the plan prints (`decide`).

An `environment.yml` is not mapped: it mixes channels, pip sections and non-Python packages
(matplotlib's needs texlive, ffmpeg, ...), so it stays refused (environment.py).
"""
from __future__ import annotations

import re
import shlex

# Conda packages that are the same project on PyPI under the same name (conda-forge/defaults build
# them from the PyPI sdist's source release). Anything else is refused: no guessing.
SAME_ON_PYPI = frozenset({"pytest", "mpmath", "flake8", "numpy", "scipy", "pandas", "cython", "matplotlib",
                          "setuptools", "joblib", "threadpoolctl"})
# Pins that PyPI has no wheel of for that Python (checked with `pip download --only-binary=:all:
# --python-version 3.9 --platform manylinux2014_x86_64`: numpy's first CPython 3.9 wheels are
# 1.19.3's, scipy's 1.5.4's): the official images have conda-forge's builds.
NO_PYPI_WHEEL = {("numpy==1.19.2", "3.9"): "numpy 1.19.2 has no CPython 3.9 wheel on PyPI",
                 ("scipy==1.5.2", "3.9"): "scipy 1.5.2 has no CPython 3.9 wheel on PyPI"}
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)(.*)$")


class CondaRefusal(ValueError):
    """The conda package list has no faithful PyPI equivalent here; the message says which and why."""


def _pip_spec(token: str) -> tuple[str, str]:
    m = _NAME.match(token)
    if m is None:
        raise CondaRefusal(f"conda package {token!r} is not a package spec")
    name, rest = m.group(1), m.group(2).strip()
    # conda's `pkg=1.2` means 1.2.*; `==`, `<`, `>=` ... read the same in pip
    if rest.startswith("=") and not rest.startswith("=="):
        rest = "==" + rest[1:] + ("" if rest.endswith("*") else ".*")
    return name.lower(), name + rest


def pypi_equivalent(packages: str, python: str) -> tuple[list[str], str]:
    """(pip requirements, the decision in words) for a spec's conda package list, or CondaRefusal."""
    reqs, why_not = [], []
    for token in shlex.split(packages):
        name, spec = _pip_spec(token)
        if name not in SAME_ON_PYPI:
            why_not.append(f"{token} (no known PyPI equivalent of the conda package)")
        elif (spec, python) in NO_PYPI_WHEEL:
            why_not.append(f"{token} ({NO_PYPI_WHEEL[(spec, python)]}; conda-forge builds it)")
        else:
            reqs.append(spec)
    if why_not:
        raise CondaRefusal(f"installs conda packages with no faithful PyPI equivalent for Python {python}: "
                           f"{', '.join(why_not)}")
    return reqs, f"conda packages {packages!r} from PyPI (same projects): {' '.join(reqs)}"
