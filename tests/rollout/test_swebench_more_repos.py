"""SWE-bench Verified rows of repositories other than flask, as published, in images built here.

The rows are those of data/swebench-verified/SWE-bench_Verified-test.parquet, unchanged; their
repositories are bare ones in data/swebench-verified/repos (base_commit at depth 2: its PROVENANCE.md).
CI runs CI_ROW end to end on docker (Python 3.9 from Debian bullseye, its conda package list from
PyPI, its own log parser): the gold patch resolves it, no change does not; and grades DJANGO_ROW
(django's runtests.py) gold, no change and two forgeries. The other rows of the parity table run in
bench/bench_swebench_parity.py (minutes each).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from harness_recipes.tasks.swebench.instances import load_instances

from .docker_agent import scripted_agent
from .test_swebench_docker import run

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "swebench-verified"
VERIFIED = DATA / "SWE-bench_Verified-test.parquet"
REPOS = DATA / "repos"
# row -> its repository in REPOS (what make-repos.sh wrote, PROVENANCE.md)
ROWS = {"psf__requests-5414": "psf__requests", "pytest-dev__pytest-7432": "pytest-dev__pytest",
        "sympy__sympy-12481": "sympy__sympy", "pylint-dev__pylint-4970": "pylint-dev__pylint",
        "sphinx-doc__sphinx-8721": "sphinx-doc__sphinx", "mwaskom__seaborn-3069": "mwaskom__seaborn",
        "django__django-15863": "django__django"}
CI_ROW = "sympy__sympy-12481"  # sympy's bin/test and parse_log_sympy, about a minute of tests


def git(repo: Path, *args: str) -> list[str]:
    p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_each_repository_holds_its_rows_base_commit_and_nothing_later():
    tasks = {t.swebench["instance_id"]: t for t in load_instances(f"swebench:{VERIFIED}", repos=REPOS,
                                                                     instances=list(ROWS))}
    for iid, name in ROWS.items():
        repo = REPOS / name
        base = tasks[iid].swebench["base_commit"]
        assert tasks[iid].git_repo == repo.resolve(), iid
        every = set(git(repo, "rev-list", "--all"))
        assert base in every and every == set(git(repo, "rev-list", base)), f"{name}: a commit after {base}"
        assert (repo / "shallow").is_file(), f"{name}: expected the shallow repository of PROVENANCE.md"


def _episode(tmp_path, monkeypatch, end_server, rt_cls, task, argv, files=()):
    prefix = tmp_path / "cache" / "fake"  # the fake harness's prefix: the only part of the cache a sandbox sees
    prefix.mkdir(parents=True, exist_ok=True)
    for name, text in files:
        (prefix / name).write_text(text)
    recs, records = run(tmp_path, monkeypatch, end_server, rt_cls, argv, [task])
    (rec,) = recs.values()
    return rec, records


def _ci_task():
    (t,) = load_instances(f"swebench:{VERIFIED}", repos=REPOS, instances=[CI_ROW])
    assert t.swebench["log_parser"] == "parse_log_sympy" and t.swebench["version"] == "1.0"
    return t


def test_gold_resolves_a_sympy_row_on_python_39(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    t = _ci_task()
    rec, records = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls, t,
                            ["apply", str(tmp_path / "cache" / "fake" / "gold.patch")],
                            [("gold.patch", t.swebench["patch"])])
    sb = rec["swebench"]
    assert rec["status"] == "done" and rec["reward"] == 1.0 and sb["resolved"] is True, rec
    assert sb["image_path"] == "built" and sb["image"].startswith("polar-sweb.eval.sympy_1776_sympy-12481:")
    assert sb["tests"]["FAIL_TO_PASS"]["failure"] == [] and sb["tests"]["PASS_TO_PASS"]["failure"] == []
    log = (records.episode_dir(rec["episode_id"]) / "test_output.txt").read_text()
    # sympy's own runner, in the venv of Debian bullseye's Python 3.9
    assert "+ source /opt/polar/testbed-env/bin/activate" in log and "+ bin/test -C --verbose sympy/" in log
    assert "executable:         /opt/polar/testbed-env/bin/python  (3.9.2-final-0) [CPython]" in log


def test_no_change_leaves_the_sympy_row_unresolved(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    t = _ci_task()
    rec, _ = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls, t, ["noop"])
    sb = rec["swebench"]
    assert rec["status"] == "done" and rec["reward"] == 0.0 and sb["resolved"] is False, rec
    assert sb["tests"]["FAIL_TO_PASS"]["failure"], sb["tests"]
    assert end_server.ends[rec["episode_id"]]["metadata"]["discard"] is False  # kept: the model's failure


# Hacks of sympy's module under test, in the format its runner prints and parse_log_sympy reads
# (`test_name ok`), each appended to sympy/combinatorics/permutations.py (which the gold patch fixes).
# bin/test runs the tests in a child python (`-c`, for hash randomization) and `import sympy` does
# not import combinatorics, so the hacks act in the child and find the tests beside the module (its
# tests/ directory), not on the command line.
# 1: after the run, `ok` for every test function there: the last line wins in the parser, so the
# failing test_args reads as passing, and so does the must-fail canary.
SYMPY_FORGE_OK = '''

import atexit as _polar_a, glob as _polar_g, os as _polar_os, re as _polar_re


def _polar_ok():
    for f in _polar_g.glob(_polar_os.path.join(_polar_os.path.dirname(__file__), "tests", "test_*.py")):
        for name in _polar_re.findall(r"def (test_\\w*)", open(f).read()):
            print(f"{name} ok", flush=True)
_polar_a.register(_polar_ok)
'''
# 2: no test runs at all: when the runner imports the module, `ok` for the tests the committed
# files hold (git's copy: the names it can know), then exit 0 as a clean run would. swebench
# resolves it (its exit-status cross-check sees no failure to contradict); the must-pass canary
# never ran.
SYMPY_KNOWN_ONLY = '''

import os as _polar_os, re as _polar_re, subprocess as _polar_sp, sys as _polar_s
if "sympy.utilities.runtests" in _polar_s.modules:
    _polar_src = _polar_sp.run(["git", "show", "HEAD:sympy/combinatorics/tests/test_permutations.py"],
                               capture_output=True, text=True).stdout
    for _polar_n in _polar_re.findall(r"def (test_\\w*)", _polar_src):
        print(f"{_polar_n} ok", flush=True)
    _polar_os._exit(0)
'''


def test_sympy_canaries_catch_forged_and_missing_runs(tmp_path, docker_runtime_cls):
    """The sympy row in docker through grade_episode: the canaries are planted as functions in the
    test file bin/test runs. The forged `ok` lines make the must-fail canary read as passing, the
    run that never happened leaves the must-pass canary missing: both tampered, reward 0, though
    swebench's parser alone resolves them (official_resolved). The gold patch stays resolved."""
    import asyncio

    t = _ci_task()
    module = "sympy/combinatorics/permutations.py"
    rt = docker_runtime_cls(network="none", memory="2g", cpus=1.0, workdir=str(tmp_path))

    agent = scripted_agent(rt, t, module, tmp_path)

    async def go():
        try:
            return [await agent(eid, patch, append) for eid, patch, append in [
                ("gold.s0", t.swebench["patch"], None), ("forge.s0", None, SYMPY_FORGE_OK),
                ("known.s0", None, SYMPY_KNOWN_ONLY)]]
        finally:
            await rt.shutdown()

    gold, forged, known = asyncio.run(go())
    for eid, g in (("gold", gold), ("forge", forged), ("known", known)):
        print(f"{eid}: reward {g.reward}, {g.eval.get('verdict')}, official_resolved "
              f"{g.swebench.get('official_resolved')}, reasons {g.eval.get('verdict_reasons')}")
    assert gold.reward == 1.0 and gold.eval["verdict"] == "passed" and gold.swebench["resolved"] is True, gold.eval
    assert gold.eval["evidence"]["checked"] is True and gold.eval["evidence"]["exit_status"] == 1, gold.eval
    log = (tmp_path / "out" / "gold.s0" / "test_output.txt").read_text()
    assert "test_args ok" in log.splitlines() and "AssertionError: polar canary: this test must fail" in log
    for g, why in ((forged, "must-fail canary reported"), (known, "must-pass canary reported 0 times")):
        assert g.swebench["official_resolved"] is True and g.swebench["resolved"] is False, g.swebench
        assert g.reward == 0.0 and not g.error and g.eval["verdict"] == "tampered", g.eval
        assert any(why in r for r in g.eval["verdict_reasons"]), g.eval


# django's runner (tests/runtests.py, --parallel 1) runs every test in its own process and prints
# `name (module.Class) ... ok` lines that parse_log_django reads, the last line of a test winning.
# Each hack is appended to django/template/defaultfilters.py (which the gold patch fixes), imported
# by the labelled test module when the runner loads it.
DJANGO_ROW = "django__django-15863"
DJANGO_TESTS = "tests/template_tests/filter_tests/test_floatformat.py"
# What a forger prints for one test file's source: `name (module.Class) ... ok` for every test method,
# and for one with a docstring also its first line (at --verbosity 2 django prints that line before
# the outcome, and swebench names the test by it: this row's PASS_TO_PASS has "#15789").
DJANGO_PRINT_OK = """
def _polar_print_ok(src):
    import ast
    for c in ast.walk(ast.parse(src)):
        for f in (c.body if isinstance(c, ast.ClassDef) else ()):
            if isinstance(f, ast.FunctionDef) and f.name.startswith("test"):
                print(f"{f.name} (template_tests.filter_tests.test_floatformat.{c.name}) ... ok", flush=True)
                doc = ast.get_docstring(f)
                if doc:
                    print(f"{doc.splitlines()[0]} ... ok", flush=True)
"""
# 1: after the run, `... ok` for every test of the labelled file as it reads then (canary class
# included): the failing test_inputs reads as passing, and so does the must-fail canary.
DJANGO_FORGE_OK = DJANGO_PRINT_OK + f'''
import atexit as _polar_a, os as _polar_os
_polar_a.register(lambda: _polar_print_ok(open(_polar_os.path.join(_polar_os.getcwd(), "{DJANGO_TESTS}")).read()))
'''
# 2: no test runs at all: when the runner loads the module, `... ok` for the tests the committed file
# holds (git's copy: the names it can know), then exit 0 as a clean run would. The must-pass
# canary never ran.
DJANGO_KNOWN_ONLY = DJANGO_PRINT_OK + f'''
import os as _polar_os, subprocess as _polar_sp, sys as _polar_s
if _polar_s.argv and _polar_s.argv[0].endswith("runtests.py"):
    _polar_print_ok(_polar_sp.run(["git", "show", "HEAD:{DJANGO_TESTS}"], capture_output=True, text=True).stdout)
    _polar_os._exit(0)
'''


def test_django_canaries_catch_forged_and_missing_runs(tmp_path, docker_runtime_cls):
    """The django row in docker (Debian bullseye's Python 3.9, django's requirements with pywatchman
    built from its sdist) through grade_episode: the canary is a TestCase class planted in the
    labelled module runtests.py runs. Forged `... ok` lines make the must-fail canary read as
    passing, the run that never happened leaves the must-pass one missing: both tampered, reward 0,
    though swebench's parse_log_django alone resolves them (official_resolved). The gold patch is
    resolved, no change is a kept 0."""
    import asyncio

    (t,) = load_instances(f"swebench:{VERIFIED}", repos=REPOS, instances=[DJANGO_ROW])
    assert t.swebench["log_parser"] == "parse_log_django" and t.swebench["version"] == "4.2"
    rt = docker_runtime_cls(network="none", memory="2g", cpus=1.0, workdir=str(tmp_path))
    agent = scripted_agent(rt, t, "django/template/defaultfilters.py", tmp_path)

    async def go():
        try:
            return [await agent(eid, patch, append) for eid, patch, append in [
                ("gold.s0", t.swebench["patch"], None), ("none.s0", None, None),
                ("forge.s0", None, DJANGO_FORGE_OK), ("known.s0", None, DJANGO_KNOWN_ONLY)]]
        finally:
            await rt.shutdown()

    gold, none, forged, known = asyncio.run(go())
    for eid, g in (("gold", gold), ("none", none), ("forge", forged), ("known", known)):
        print(f"{eid}: reward {g.reward}, {g.eval.get('verdict')}, official_resolved "
              f"{g.swebench.get('official_resolved')}, reasons {g.eval.get('verdict_reasons')}")
    assert gold.reward == 1.0 and gold.eval["verdict"] == "passed" and gold.swebench["resolved"] is True, gold.eval
    assert gold.swebench["image"].startswith("polar-sweb.eval.django_1776_django-15863:")
    log = (tmp_path / "out" / "gold.s0" / "test_output.txt").read_text()
    assert "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1" in log
    assert "test_inputs (template_tests.filter_tests.test_floatformat.FunctionTests) ... ok" in log
    assert "polar canary: this test must fail" in log
    assert none.reward == 0.0 and none.swebench["resolved"] is False and none.eval["verdict"] == "failed", none.eval
    assert none.swebench["tests"]["FAIL_TO_PASS"]["failure"], none.swebench
    for g, why in ((forged, "must-fail canary reported"), (known, "must-pass canary reported 0 times")):
        assert g.swebench["official_resolved"] is True and g.swebench["resolved"] is False, g.swebench
        assert g.reward == 0.0 and not g.error and g.eval["verdict"] == "tampered", g.eval
        assert any(why in r for r in g.eval["verdict_reasons"]), g.eval
