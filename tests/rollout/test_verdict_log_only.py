"""Canaries for SWE-bench's runners that write no structured result: sympy's bin/test and django's
tests/runtests.py (harness_recipes/verdict/swebench.py).

The eval scripts are the real published rows' (data/swebench-verified); the logs here are
SYNTHETIC, written in each runner's format and read by swebench's own parser (parse_log_sympy,
parse_log_django): a unit test of the verdict, not a run. Real runs: sympy's row in docker
(tests/rollout/test_swebench_more_repos.py); django has no repository here, so no run.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from swebench.harness.log_parsers.python import parse_log_django, parse_log_sympy

from harness_recipes.tasks.swebench.eval_script import script_for
from harness_recipes.tasks.swebench.instances import load_instances
from harness_recipes.verdict.swebench import instrument_script, judge_swebench

ROOT = Path(__file__).resolve().parents[2]
VERIFIED = ROOT / "data" / "swebench-verified" / "SWE-bench_Verified-test.parquet"
SYMPY, DJANGO, DJANGO2 = "sympy__sympy-12481", "django__django-11099", "django__django-16255"
EXIT = ">>>>> Test Exit Code"


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    return {t.swebench["instance_id"]: t.swebench
            for t in load_instances(f"swebench:{VERIFIED}", instances=[SYMPY, DJANGO, DJANGO2])}


def test_sympy_gets_function_canaries_in_the_files_it_runs(rows):
    ins = instrument_script(script_for(rows[SYMPY], "built"), "/root")
    assert ins.canaries is not None and ins.junit is None and not ins.why, ins.why
    assert ins.files == ("sympy/combinatorics/tests/test_permutations.py",)
    ok, bad = ins.canaries.names()
    # module-level functions (sympy collects test_* functions of the file), appended after
    # test_patch is applied and before the test command, which is left as it was
    assert f"\ndef {ok}():\n    pass\n" in ins.script and f"\ndef {bad}():\n    assert False" in ins.script
    assert ins.canaries.cls not in ins.script
    lines = ins.script.splitlines()
    cmd = next(i for i, line in enumerate(lines) if line.startswith("PYTHONWARNINGS="))
    assert lines[cmd].endswith("bin/test -C --verbose sympy/combinatorics/tests/test_permutations.py")
    assert ins.script.index("git apply -v -") < ins.script.index(f"def {ok}") < ins.script.index("Start Test Output")


@pytest.mark.parametrize("iid,files", [
    (DJANGO, ("tests/auth_tests/test_validators.py",)),
    # a label that is not a test_*.py module (a URLconf of the test_patch) gets them too: django
    # loads a label's TestCase classes whatever the module
    (DJANGO2, ("tests/sitemaps_tests/test_http.py", "tests/sitemaps_tests/urls/http.py")),
])
def test_django_gets_a_canary_class_in_each_labels_module(rows, iid, files):
    inst = rows[iid]
    ins = instrument_script(script_for(inst, "official"), "/root")
    assert ins.canaries is not None and ins.junit is None and ins.files == files, ins
    # each file is one the test_patch writes (SWE-bench makes the labels from its paths)
    assert all(f"diff --git a/{f} b/{f}" in inst["test_patch"] for f in files)
    assert f"class {ins.canaries.cls}(" in ins.script


def test_django_failfast_gets_no_canaries():
    script = ": '>>>>> Start Test Output'\n./tests/runtests.py --failfast a.tests\n: '>>>>> End Test Output'\n"
    ins = instrument_script(script, "/root")
    assert ins.canaries is None and "first failure" in ins.why


def sympy_log(ok: str, bad: str, *, forged: bool = False, exit_code: int = 1, must_pass: bool = True) -> str:
    """A sympy --verbose log of the row's file: the real tests pass (a fixed run), the canaries as
    planted, then swebench's exit-status line; ``forged``: an atexit hook printed `NAME ok` for
    every test function of the file, canaries included."""
    tests = ["test_Permutation", "test_josephus", "test_args"]
    body = [f"{t} ok" for t in tests] + ([f"{ok} ok"] if must_pass else []) + [f"{bad} F"]
    fail = [f"___ sympy/combinatorics/tests/test_permutations.py:{bad} ___", "AssertionError: polar canary"]
    out = ["sympy/combinatorics/tests/test_permutations.py[5] ", *body, "", *fail, "", "=== tests finished ==="]
    if forged:
        out += [f"{t} ok" for t in [*tests, ok, bad]]
    return "\n".join([": '>>>>> Start Test Output'", *out, ": '>>>>> End Test Output'", f"{EXIT}: {exit_code}", ""])


def judge(ins, log: str, parse, f2p: list[str]):
    """``found``: the test output markers are there (get_logs_eval's first check; its others are
    swebench's own, run on the real log in the docker test)."""
    status = parse(log, None)
    report = {"resolved": all(status.get(t) == "PASSED" for t in f2p)}
    return judge_swebench(ins, log, report, status, "Start Test Output" in log, f2p, None, False)


def test_sympy_verdicts_on_its_log_format(rows):
    ins = instrument_script(script_for(rows[SYMPY], "built"), "/root")
    ok, bad = ins.canaries.names()
    honest = judge(ins, sympy_log(ok, bad), parse_log_sympy, ["test_args"])
    assert honest.status == "passed" and honest.reward == 1.0, honest
    # the must-fail canary reported passing (the forged `ok` lines win in swebench's parser)
    forged = judge(ins, sympy_log(ok, bad, forged=True), parse_log_sympy, ["test_args"])
    assert forged.status == "tampered" and forged.reward == 0.0, forged
    assert any("must-fail canary" in r for r in forged.reasons), forged.reasons
    # the must-pass canary missing (a log written without running the tests)
    missing = judge(ins, sympy_log(ok, bad, must_pass=False), parse_log_sympy, ["test_args"])
    assert missing.status == "tampered" and any("must-pass canary reported 0 times" in r for r in missing.reasons)
    # the exit status forged to 0 (atexit os._exit(0)): the must-fail canary ran, so it cannot be
    exit0 = judge(ins, sympy_log(ok, bad, exit_code=0), parse_log_sympy, ["test_args"])
    assert exit0.status == "tampered" and any("exit status 0" in r for r in exit0.reasons), exit0.reasons
    # a fix that breaks the module: the test file does not import, no test and no canary runs:
    # the code's failure, not tampering (as pytest's collection errors)
    broken = "\n".join([": '>>>>> Start Test Output'", "sympy/combinatorics/tests/test_permutations.py[?]   "
                        "Failed to import                                      [FAIL]", "",
                        "____ sympy/combinatorics/tests/test_permutations.py ____", "SyntaxError: invalid syntax",
                        ": '>>>>> End Test Output'", f"{EXIT}: 1", ""])
    b = judge(ins, broken, parse_log_sympy, ["test_args"])
    assert b.status == "failed" and b.reward == 0.0 and any("did not load" in r for r in b.reasons), b
    # ... but the same log with the real tests printed as passing is the known-names forgery
    known = broken.replace("[FAIL]", "[FAIL]\ntest_args ok\ntest_Permutation ok")
    k = judge(ins, known, parse_log_sympy, ["test_args"])
    assert k.status == "tampered" and any("must-pass canary reported 0 times" in r for r in k.reasons), k
    # nothing the parser can read: unreadable, a kept 0, never a discard
    errored = judge(ins, f"{EXIT}: 1\n", parse_log_sympy, ["test_args"])
    assert errored.status == "unreadable" and errored.reward == 0.0


def django_log(tests: list[str], cls: str, ok: str, bad: str, *, forged: bool = False, exit_code: int = 1,
               must_pass: bool = True) -> str:
    """A django runtests.py --verbosity 2 log of the row's module (unittest's text runner), every
    real test in ``tests`` passing."""
    mod = "auth_tests.test_validators"
    real = [f"{t} ... ok" for t in tests]
    can = ([f"{ok} ({mod}.{cls}) ... ok"] if must_pass else []) + [f"{bad} ({mod}.{cls}) ... FAIL"]
    tail = ["", "=" * 70, f"FAIL: {bad} ({mod}.{cls})", "-" * 70, "AssertionError: polar canary: this test must fail",
            "", "-" * 70, f"Ran {len(real) + len(can)} tests in 0.01s", "", "FAILED (failures=1)"]
    out = [*real, *can, *tail]
    if forged:
        out += [f"{line.split(' ... ')[0]} ... ok" for line in [*real, *can]]
    return "\n".join([": '>>>>> Start Test Output'", *out, ": '>>>>> End Test Output'", f"{EXIT}: {exit_code}", ""])


def test_django_verdicts_on_its_log_format(rows):
    inst = rows[DJANGO]
    ins = instrument_script(script_for(inst, "official"), "/root")
    cls, (ok, bad) = ins.canaries.cls, ins.canaries.names()
    f2p = inst["FAIL_TO_PASS"]
    log = lambda **kw: django_log(f2p + inst["PASS_TO_PASS"], cls, ok, bad, **kw)  # noqa: E731
    honest = judge(ins, log(), parse_log_django, f2p)
    assert honest.status == "passed" and honest.reward == 1.0, honest
    forged = judge(ins, log(forged=True), parse_log_django, f2p)
    assert forged.status == "tampered" and any("must-fail canary" in r for r in forged.reasons), forged
    missing = judge(ins, log(must_pass=False), parse_log_django, f2p)
    assert missing.status == "tampered" and any("must-pass canary" in r for r in missing.reasons), missing
    exit0 = judge(ins, log(exit_code=0), parse_log_django, f2p)
    assert exit0.status == "tampered" and exit0.reward == 0.0
    # the canaries never reach the reported tests
    assert not any(cls in t for t in forged.tests)
