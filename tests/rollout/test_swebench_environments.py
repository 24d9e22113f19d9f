"""What SWE-bench environments can be built here, decided before any build (no docker, no network):
Debian bullseye's Python 3.9 beside bookworm's 3.11, a user's interpreter for the versions neither
has, conda package lists from PyPI where faithful, the date cap, each decision said in words."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.tasks.swebench.conda_packages import CondaRefusal, pypi_equivalent
from harness_recipes.tasks.swebench.environment import RESOLVED_BEFORE, Refused, environment, install_target, spec_refusal
from harness_recipes.tasks.swebench.images import SUITE_PACKAGES, base_key, base_tag, dockerfile
from harness_recipes.tasks.swebench.instances import load_instances
from harness_recipes.tasks.swebench.pythons import PythonError, interpreter, missing, parse_pythons
from harness_recipes.tasks.swebench.specs import spec_for

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "swebench-verified"
VERIFIED = DATA / "SWE-bench_Verified-test.parquet"
REPOS = DATA / "repos"


def fake_python(tmp_path: Path, version: str, says: str | None = None) -> Path:
    """A prefix whose bin/pythonX.Y answers the version check as a CPython of `says` would."""
    exe = tmp_path / f"cpython-{version}" / "bin" / f"python{version}"
    exe.parent.mkdir(parents=True)
    exe.write_text(f"#!/bin/sh\necho {says or version}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe.parent.parent


def test_python_39_comes_from_bullseye_and_311_from_bookworm():
    assert interpreter("3.9").suite == "bullseye" and interpreter("3.11").suite == "bookworm"
    assert interpreter("3.9").executable == "python3" and interpreter("3.6") is None
    assert "bullseye" in SUITE_PACKAGES and base_tag("bullseye") != base_tag("bookworm")
    # bookworm's base keeps its name and key (its images, cached in engines, stay valid)
    assert base_tag() == f"polar-swebench-base:{base_key('bookworm')}"
    why = missing("3.6")
    assert why.startswith("needs Python 3.6;") and "--python 3.6=DIR" in why and "3.9 (bullseye)" in why


def test_user_pythons_are_checked_up_front(tmp_path):
    good = fake_python(tmp_path, "3.6")
    assert parse_pythons([f"3.6={good}"]) == {"3.6": str(good.resolve())}
    with pytest.raises(PythonError, match="expected X.Y=DIR"):
        parse_pythons(["3.6"])
    with pytest.raises(PythonError, match=r"no .*/bin/python3\.8"):
        parse_pythons([f"3.8={tmp_path / 'nowhere'}"])
    with pytest.raises(PythonError, match="says it is Python 3.7"):
        parse_pythons([f"3.8={fake_python(tmp_path, '3.8', says='3.7')}"])
    with pytest.raises(PythonError, match="comes from Debian bullseye"):
        parse_pythons([f"3.9={good}"])
    it = interpreter("3.6", {"3.6": str(good)})
    assert it.suite == "bookworm" and it.executable == f"{good}/bin/python3.6" and it.source == good


def test_the_cli_refuses_a_missing_interpreter_before_reading_rows(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **{k: v for k, v in os.environ.items()
                                                                if k in ("POLAR_CACHE", "HOME")}}
    p = subprocess.run([sys.executable, "-m", "harness_recipes.cli", "swebench", "plan", f"swebench:{VERIFIED}",
                        "--python", f"3.6={tmp_path}"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode == 2 and "--python 3.6=" in p.stderr and "bin/python3.6" in p.stderr, p.stderr


def test_conda_lists_map_to_pypi_only_where_faithful():
    reqs, said = pypi_equivalent("mpmath flake8", "3.9")
    assert reqs == ["mpmath", "flake8"] and "from PyPI" in said
    assert pypi_equivalent("pytest", "3.9")[0] == ["pytest"]
    assert pypi_equivalent("numpy=1.19", "3.9")[0] == ["numpy==1.19.*"]  # conda's `=` is a prefix match
    sklearn = spec_for("scikit-learn/scikit-learn", "1.3")["packages"]
    with pytest.raises(CondaRefusal, match=r"numpy==1\.19\.2 \(numpy 1\.19\.2 has no CPython 3\.9 wheel"):
        pypi_equivalent(sklearn, "3.9")
    with pytest.raises(CondaRefusal, match="no known PyPI equivalent"):
        pypi_equivalent("pytest libgdal", "3.9")


def test_specs_decide_in_words():
    requests = spec_for("psf/requests", "2.26")
    assert spec_refusal("psf/requests", requests) == ""
    assert spec_refusal("pylint-dev/pylint", spec_for("pylint-dev/pylint", "2.10")) == ""
    assert spec_refusal("django/django", spec_for("django/django", "3.0")).startswith("needs Python 3.6;")
    assert spec_refusal("django/django", spec_for("django/django", "3.0"), {"3.6": "/opt/py36"}) == ""
    assert "environment.yml" in spec_refusal("matplotlib/matplotlib", spec_for("matplotlib/matplotlib", "3.5"))
    assert "apt-get" in spec_refusal("sphinx-doc/sphinx", spec_for("sphinx-doc/sphinx", "7.2"))
    assert install_target("python -m pip install -e .[test] --verbose") == ".[test]"
    assert install_target("python -m pip install -e '.[dev]'") == ".[dev]"
    assert install_target("python setup.py install") == "."


def test_an_official_39_row_gets_a_bullseye_environment_capped_by_date():
    (t,) = load_instances(f"swebench:{VERIFIED}", repos=REPOS, instances=["sympy__sympy-12481"])
    env = environment(t.swebench, t.git_repo, REPOS)
    assert (env.python, env.suite, env.executable) == ("3.9", "bullseye", "python3")
    assert env.conda == ["mpmath", "flake8"] and env.resolved_before == RESOLVED_BEFORE
    said = env.describe()
    assert said.startswith("Debian bullseye Python 3.9, conda packages 'mpmath flake8' from PyPI") and \
        f"resolved as of {RESOLVED_BEFORE}" in said
    df = dockerfile(base_tag("bullseye"), env)
    assert df.startswith(f"FROM {base_tag('bullseye')}") and "pip install -q mpmath flake8" in df
    # the date cap and the interpreter are part of what the image is made of
    from dataclasses import replace
    assert env.key() != replace(env, resolved_before="2024-01-01T00:00:00Z").key()


def test_a_user_interpreter_goes_into_the_image_at_its_own_path(tmp_path):
    py36 = fake_python(tmp_path, "3.6")
    (t,) = load_instances(f"swebench:{VERIFIED}", repos=REPOS, instances=["sympy__sympy-12481"],
                          pythons={"3.6": str(py36)})
    inst = {**t.swebench, "version": "1.0"}
    # the row's spec says 3.9; one that says 3.6 (django 3.0's) refuses without the interpreter...
    dj = {**inst, "repo": "django/django", "version": "3.0", "polar_pythons": None}
    with pytest.raises(Refused, match="needs Python 3.6"):
        environment(dj, t.git_repo, REPOS)
    # ...and with it, stops only at the repository (this one is sympy's): the Python is settled
    with pytest.raises(Refused, match="no local repository"):
        environment({**dj, "polar_pythons": {"3.6": str(py36)}}, None, REPOS)
    assert t.swebench["polar_pythons"] == {"3.6": str(py36)}


def test_the_plan_counts_what_builds_and_what_waits_for_its_repository(tmp_path):
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
           **{k: v for k, v in os.environ.items() if k in ("POLAR_CACHE", "HOME")}, "DOCKER_HOST": "unix:///nonexistent"}
    p = subprocess.run([sys.executable, "-m", "harness_recipes.cli", "swebench", "plan", f"swebench:{VERIFIED}",
                        "--repos", str(REPOS), "--instances",
                        "sympy__sympy-12481,psf__requests-5414,django__django-11099,scikit-learn__scikit-learn-25232",
                        "--json"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    by_id = {d["instance_id"]: d for d in json.loads(p.stdout)["instances"]}
    assert by_id["sympy__sympy-12481"]["path"] == "build"
    assert by_id["psf__requests-5414"]["reason"].startswith("Debian bullseye Python 3.9, conda packages 'pytest'")
    assert by_id["django__django-11099"]["reason"].startswith("needs Python 3.6;")
    assert "numpy==1.19.2" in by_id["scikit-learn__scikit-learn-25232"]["reason"]
