"""The verdict's pieces without a sandbox: which evals are instrumented, the parsers of each
source, the cross-check on crafted records (harness_recipes/verdict/)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness_recipes.runtimes.base import ExecResult
from harness_recipes.verdict.canaries import PREFIX, Canaries, without_canaries
from harness_recipes.verdict.command import Instrumented, judge, plan_command
from harness_recipes.verdict.evidence import junit_collection_errors, junit_outcomes, pytest_summary, unittest_summary

FILES = {"test_calc.py", "tests/test_x.py", "pkg/test_m.py"}


@pytest.mark.parametrize("cmd,mode,files,targets", [
    ("git checkout -q HEAD -- test_calc.py && python3 -m unittest -q test_calc", "unittest", ("test_calc.py",), ()),
    ("/v/bin/python -m pytest -q -p no:cacheprovider test_calc.py", "pytest", ("test_calc.py",), ()),
    ("python -m pytest tests/test_x.py::TestA::test_b", "pytest", ("tests/test_x.py",),
     (("tests/test_x.py", "tests/test_x.py::{cls}"),)),
    ("python3.11 -m unittest pkg.test_m.TestX", "unittest", ("pkg/test_m.py",), (("pkg/test_m.py", "pkg.test_m.{cls}"),)),
    ("python -m unittest test_calc.TestAdd test_calc", "unittest", ("test_calc.py",), ()),
])
def test_instrumented_evals(cmd, mode, files, targets):
    p = plan_command(cmd, lambda r: r in FILES)
    assert p.checked and p.mode == mode and p.files == files and p.targets == targets, p
    assert cmd[p.span[0]:p.span[1]].endswith(f"-m {mode}")


@pytest.mark.parametrize("cmd,why", [
    ("make test", "exactly one is instrumented"),
    ("python -m pytest a.py; python -m pytest test_calc.py", "exactly one"),
    ("python -m unittest discover", "discovery"),
    ("python -m pytest -k add test_calc.py", "-k selects tests"),
    ("python -m pytest -m slow test_calc.py", "-m selects tests"),
    ("python -m pytest tests/", "no test file"),
    ("python -m pytest nothere.py", "no test file"),
    ("cd sub && python3 -m unittest test_calc", "changes directory"),
    ("python -m pytest -x test_calc.py", "-x stops at the first failure"),
    ("python -m pytest -qx test_calc.py", "-qx stops"),
    ("python -m pytest --maxfail=2 test_calc.py", "--maxfail=2 stops"),
    ("python3 -m unittest -f test_calc", "-f stops"),
    ("python -m unittest 'test_calc", "cannot read"),
])
def test_evals_left_unchecked_say_why(cmd, why):
    p = plan_command(cmd, lambda r: r in FILES)
    assert not p.checked and why in p.why, p


def test_canaries_are_fresh_valid_code_and_checked_both_ways():
    a, b = Canaries.draw(), Canaries.draw()
    assert a != b and a.cls.startswith(PREFIX) and len({a.cls, a.must_pass, a.must_fail}) == 3
    compile("import unittest\n" + a.block(), "t.py", "exec")
    good = {f"t.{a.cls}.{a.must_pass}": "passed", f"t.{a.cls}.{a.must_fail}": "failed", "t.T.test_x": "failed"}
    assert a.check(good, 1) == [] and without_canaries(good, a) == {"t.T.test_x": "failed"}
    forged = {**good, f"t.{a.cls}.{a.must_fail}": "passed"}
    assert a.check(forged, 1) == ["must-fail canary reported ['passed']"]
    assert "must-pass canary reported 0 times for 1 planted" in a.check({"t.T.test_x": "passed"}, 1)
    assert len(a.check(good, 2)) == 2  # planted in two files, reported for one


def test_parsers_of_each_source():
    xml = ('<testsuites><testsuite><testcase classname="t.T" name="test_a"/>'
           '<testcase classname="t.T" name="test_b"><failure message="x"/></testcase>'
           '<testcase classname="t" name="test_c"><skipped type="pytest.xfail" message="xfail"/></testcase>'
           '<testcase classname="" name="u"><error message="collection failure"/></testcase></testsuite></testsuites>')
    assert junit_outcomes(xml) == {"t.T::test_a": "passed", "t.T::test_b": "failed", "t::test_c": "xfailed",
                                   "::u": "error"}
    assert junit_collection_errors(xml) == ["::u"]
    with pytest.raises(ValueError, match="not XML"):
        junit_outcomes("<oops")
    with pytest.raises(ValueError, match="not JUnit XML"):
        junit_outcomes("<html/>")
    assert pytest_summary("x\n1 failed, 2 passed, 1 warning in 0.05s\n") == [{"failed": 1, "passed": 2, "warnings": 1}]
    assert pytest_summary("==== 3 passed in 1.20s ====\n") == [{"passed": 3}]
    text = "...\n---\nRan 3 tests in 0.001s\n\nFAILED (failures=2, errors=1)\n"
    assert unittest_summary(text) == [{"ran": 3, "ok": False, "failures": 2, "errors": 1}]
    assert unittest_summary(text + "Ran 3 tests in 0.001s\n\nOK\n")[1] == {"ran": 3, "ok": True}


def _run(tmp_path: Path, record, rc: int, out: str = "") -> tuple:
    can = Canaries.draw()
    result = tmp_path / "r.out"
    if record is not None:
        result.write_text(record if isinstance(record, str) else json.dumps(record(can)))
    ins = Instrumented("cmd", can, result, tmp_path / "r.xml", ("test_calc.py",))
    return judge("unittest", ins, ExecResult(rc, b"", out.encode(), False, 0.1)), can


def _honest(can, real="failed"):
    tests = {"test_calc.TestAdd.test_add": real, f"test_calc.{can.cls}.{can.must_pass}": "passed",
             f"test_calc.{can.cls}.{can.must_fail}": "failed"}
    n = 1 + (real == "failed")
    return {"mode": "unittest", "planted": ["test_calc.py"], "exit": 1, "tests": tests,
            "events": {"failures": n, "errors": 0, "subtests": 0}}


def test_judging_crafted_records(tmp_path):
    summary = "Ran 3 tests in 0.01s\n\nFAILED (failures={})\n"
    v, _ = _run(tmp_path, lambda c: _honest(c, "passed"), 1, summary.format(1))
    assert v.status == "passed" and v.reward == 1.0 and v.tests == {"test_calc.TestAdd.test_add": "passed"}, v
    v, _ = _run(tmp_path, lambda c: _honest(c), 1, summary.format(2))
    assert v.status == "failed" and v.reward == 0.0, v
    # the real test's outcome rewritten to passed: unittest printed 2 failures
    v, _ = _run(tmp_path, lambda c: {**_honest(c, "passed"), "events": {"failures": 2, "errors": 0, "subtests": 0}},
                1, summary.format(2))
    assert v.status == "tampered" and "disagrees" in v.reasons[0], v
    # exit 0 against the runner's 1
    v, _ = _run(tmp_path, lambda c: _honest(c, "passed"), 0, summary.format(1))
    assert v.tampered and any("exit status 0" in r for r in v.reasons), v
    # a record that is not the runner's, and no record at all
    v, _ = _run(tmp_path, lambda c: {**_honest(c), "tests": {"x": {"nested": 1}}}, 1)
    assert v.tampered and "not one the runner writes" in v.reasons[0], v
    v, _ = _run(tmp_path, lambda c: {**_honest(c), "events": {"failures": "2"}}, 1)
    assert v.tampered, v
    assert _run(tmp_path / "none", None, 1)[0].status == "unreadable"
    assert _run(tmp_path / "none0", None, 0)[0].tampered
    assert _run(tmp_path, "{not json", 1)[0].status == "unreadable"
    # a timeout is a kept 0
    can = Canaries.draw()
    ins = Instrumented("cmd", can, tmp_path / "x", tmp_path / "y", ())
    assert judge("unittest", ins, ExecResult(None, b"", b"", True, 9.0)).status == "timed_out"
