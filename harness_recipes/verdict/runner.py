"""Polar's test runner for graded command tasks: the structured result the verdict is read from.

Not imported by the node: command.py copies this file into the grading sandbox (a directory it
creates outside the workspace, under a random name) and runs the task's own
``python -m unittest|pytest ARGS`` as ``python -c "exec(open(RUNNER).read())" SPEC unittest|pytest ARGS``
(``-c`` puts the working directory first on sys.path exactly as ``-m`` does). Standard library
only: it runs under whatever python the task's eval command names.

Before any test code runs it reads the spec (the result path, the canary block, the files to plant
it in) and deletes it, plants the canaries, opens the result file; then it runs the tests and
writes what it recorded: unittest outcomes recorded by its own result class (before the
framework's own bookkeeping, which the code under test may have patched), or pytest's JUnit XML;
the exit status the framework returned; the files it planted; a named test module that did not
import (``load_error``). The node compares this with the
process's exit status and the printed summary (verdict/command.py).
"""
import json
import os
import stat
import sys

RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4}


def _plant(files, block):
    planted = []
    for rel in files:
        try:
            st = os.lstat(rel)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode):  # a symlink is not followed: it could point anywhere
            continue
        with open(rel, "a") as f:
            f.write(block)
        planted.append(rel)
    return planted


def _unittest(args):
    import unittest

    tests = {}
    events = {"failures": 0, "errors": 0, "subtests": 0}  # as unittest counts them (each failing subtest once)
    base = unittest.TextTestResult

    def note(test, outcome):
        tid = test.id()
        if RANK[outcome] >= RANK.get(tests.get(tid, "passed"), 0):
            tests[tid] = outcome

    class Result(base):
        def addSuccess(self, test):
            note(test, "passed")
            base.addSuccess(self, test)

        def addFailure(self, test, err):
            note(test, "failed")
            events["failures"] += 1
            base.addFailure(self, test, err)

        def addError(self, test, err):
            note(test, "error")
            events["errors"] += 1
            base.addError(self, test, err)

        def addSkip(self, test, reason):
            note(test, "skipped")
            base.addSkip(self, test, reason)

        def addExpectedFailure(self, test, err):
            note(test, "xfailed")
            base.addExpectedFailure(self, test, err)

        def addUnexpectedSuccess(self, test):
            note(test, "xpassed")
            base.addUnexpectedSuccess(self, test)

        def addSubTest(self, test, subtest, err):
            if err is not None:
                failed = issubclass(err[0], test.failureException)
                note(test, "failed" if failed else "error")
                events["failures" if failed else "errors"] += 1
                events["subtests"] += 1
            base.addSubTest(self, test, subtest, err)

    class Runner(unittest.TextTestRunner):
        resultclass = Result

    try:
        unittest.main(module=None, argv=["python -m unittest", *args], testRunner=Runner, exit=False)
    except Exception as e:  # a named test module that does not import: unittest raises (as `-m unittest`)
        import traceback
        traceback.print_exc()
        return {"<load error>": "error"}, 1, {"load_error": f"{type(e).__name__}: {e}"[:300]}
    # The exit status unittest gives (1 on any failure, error or unexpected success), from our record
    # rather than from its result object's wasSuccessful(), which the code under test can patch.
    bad = any(o in ("failed", "error", "xpassed") for o in tests.values())
    return tests, 1 if bad else 0, {"events": events}


def _pytest(args, junit):
    import pytest

    return None, int(pytest.main([*args, "--junitxml=" + junit, "-o", "junit_family=xunit2"])), {}


def _main():
    spec_path, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(spec_path) as f:
        spec = json.load(f)
    os.unlink(spec_path)
    out = os.open(spec["result"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    planted = _plant(spec["plant"], spec["block"])
    # a test file named only in part (one class or test) also gets its canary class named
    args = args + [target for rel, target in spec["targets"] if rel in planted]
    if mode == "unittest":
        tests, code, extra = _unittest(args)
    else:
        tests, code, extra = _pytest(args, spec["junit"])
    with os.fdopen(out, "w") as f:
        f.write(json.dumps({"mode": mode, "planted": planted, "exit": code, "tests": tests, **extra}))
        f.flush()
        os.fsync(f.fileno())
    return code


if __name__ == "__main__":  # run as `python -c "exec(...)"`; importing it does nothing
    sys.exit(_main())
