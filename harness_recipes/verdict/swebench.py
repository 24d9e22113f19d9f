"""The verdict of a SWE-bench instance: swebench's own, cross-checked with evidence it does not read.

swebench's parser reads the printed log (the last ``PASSED``/``FAILED`` line of a test wins; a
``>>>>> Tests Errored`` anywhere voids it), which the code under test can print. The eval script
(tasks/swebench/eval_script.py, official) is instrumented here, changing nothing of what it runs:
- the ``>>>>> Test Exit Code: N`` line swebench's get_logs_eval checks, written exactly as swebench's
  own ``record_test_exit_code`` writes it (after the end-of-output marker);
- pytest-run instances (the test command runs pytest with ``-rA``, so the log lists every outcome):
  a canary class appended to each test file on the command line after test_patch is applied, and
  ``--junitxml`` to a file under a directory the node made with a random name outside /testbed;
- sympy's ``bin/test`` (its log parser reads ``test_name ok`` / ``F`` / ``E``): the canaries as two
  module-level functions appended to each test file on the command line; no structured result
  (the runner writes none), so its verdict rests on the parser, the canaries and the exit status;
- django's ``tests/runtests.py`` (unittest at verbosity 2: ``test_name (module.Class) ... ok``):
  the canary class appended to the test module of each label on the command line
  (``a.b`` -> ``tests/a/b.py``); the same log-only evidence as sympy.

The reward stays swebench's ``resolved`` (parity with published results) unless the evidence
disagrees: the parser's and the JUnit XML's outcomes of the FAIL_TO_PASS / PASS_TO_PASS tests, the
canaries in both, the exit status against the XML's failures, a single exit-status line (log-only
runners: the canaries in the parser's outcomes, and a non-zero exit status, which the must-fail
canary makes the only honest one). Then the verdict is ``tampered``. A log swebench reads nothing
from is a 0 (``unreadable``), or ``tampered`` when the XML shows the tests ran: never a discard.
"""
from __future__ import annotations

import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

from harness_recipes.verdict.canaries import Canaries, without_canaries
from harness_recipes.verdict.evidence import (
    FAILED,
    PASSED,
    TIMED_OUT,
    UNREADABLE,
    Verdict,
    count,
    junit_collection_errors,
    junit_outcomes,
    tampered,
)

PARSER_STATUS = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped", "XFAIL": "xfailed"}


def _markers() -> dict[str, str]:
    from swebench.harness import constants as c
    return {"start": c.START_TEST_OUTPUT, "end": c.END_TEST_OUTPUT, "exit": c.TEST_EXIT_CODE}


@dataclass
class Instrumented:
    script: str
    canaries: Canaries | None = None  # None: a runner the node cannot plant canaries for
    junit: Path | None = None  # None with canaries: a log-only runner (sympy, django)
    files: tuple[str, ...] = ()  # the test files the canaries were planted in
    why: str = ""  # why not checked


def _test_line(lines: list[str], start: str) -> int | None:
    """The index of the test command: the line after the start-of-output marker."""
    for i, line in enumerate(lines):
        if start in line and i + 1 < len(lines):
            return i + 1
    return None


def instrument_script(script: str, home: str) -> Instrumented:
    """The eval script with the exit-status line, and for pytest -rA runs the canaries and the XML.
    ``home``: the sandbox's home (outside /testbed, the same path on the host)."""
    from swebench.harness.utils import record_test_exit_code
    m = _markers()
    lines = script.split("\n")
    if not any(m["exit"] in line for line in lines):
        lines = record_test_exit_code(lines)
    i = _test_line(lines, m["start"])
    if i is None:
        return Instrumented("\n".join(lines), why="no start-of-output marker in the eval script")
    cmd = lines[i]
    try:
        words = shlex.split(cmd)
    except ValueError as e:
        return Instrumented("\n".join(lines), why=f"cannot read the test command: {e}")
    runner = _runner(words)
    if runner is None:
        return Instrumented("\n".join(lines), why="the test command is not a pytest -rA run, sympy's bin/test or "
                                                   "django's runtests.py: swebench's parser and the exit status only")
    if any(w.split("=", 1)[0] in STOP_FIRST for w in words):
        return Instrumented("\n".join(lines), why="the test command stops at the first failure: canaries may not run")
    test_files = _test_files(runner, words)
    if not test_files:
        return Instrumented("\n".join(lines), why="the test command names no test file for the canaries")
    can = Canaries.draw()
    junit = Path(home) / f".polar-{secrets.token_hex(8)}" / f"{secrets.token_hex(8)}.xml" if runner == "pytest" else None
    eof = f"EOF_POLAR_{secrets.token_hex(8)}"
    block = can.functions_block() if runner == "sympy" else can.block()
    # planted after test_patch is applied (it comes before the marker), in regular files only
    plant = [f"[ -f {shlex.quote(f)} ] && [ ! -L {shlex.quote(f)} ] && cat >> {shlex.quote(f)} <<'{eof}'\n"
             f"{block}{eof}" for f in test_files]
    run = f"{cmd} --junitxml={shlex.quote(str(junit))}" if junit else cmd
    lines = [*lines[: i - 1], *plant, lines[i - 1], run, *lines[i + 1:]]
    return Instrumented("\n".join(lines), can, junit, test_files)


# options that stop a run at its first failure (pytest, django's runner): a canary may never run
STOP_FIRST = ("-x", "--exitfirst", "--maxfail", "--failfast")
LABEL = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def _runner(words: list[str]) -> str | None:
    """Which runner the test command runs, of those the node plants canaries for."""
    if "pytest" in " ".join(words) and "-rA" in words:
        return "pytest"
    if any(w == "bin/test" or w.endswith("/bin/test") for w in words):
        return "sympy"
    if any(w.endswith("runtests.py") for w in words):
        return "django"
    return None


def _test_files(runner: str, words: list[str]) -> tuple[str, ...]:
    """The test files the command runs, relative to /testbed: pytest's and sympy's as named (a
    pytest node id's file part); django's labels are test modules under tests/ (SWE-bench writes
    them from test_patch's paths: tests/a/b.py -> a.b). A label naming a class or a method (not
    SWE-bench's) would name no file: its canaries would be missing, a false `tampered`."""
    if runner != "django":
        return tuple(dict.fromkeys(w.split("::")[0] for w in words if w.split("::")[0].endswith(".py")))
    at = next(i for i, w in enumerate(words) if w.endswith("runtests.py"))
    return tuple(dict.fromkeys(f"tests/{w.replace('.', '/')}.py" for w in words[at + 1:] if LABEL.match(w)))


def exit_codes(log: str) -> list[int]:
    """The exit-status lines printed (a line of its own: ``set -x``'s trace of the echo is not one)."""
    marker = re.escape(_markers()["exit"])
    return [int(c) for c in re.findall(rf"^{marker}:\s*(-?\d+)[ \t]*$", log, re.M)]


def parser_outcomes(status_map: dict[str, str]) -> dict[str, str]:
    return {t: PARSER_STATUS.get(s, s.lower()) for t, s in status_map.items()}


def junit_nodeids(junit: dict[str, str], files: tuple[str, ...]) -> dict[str, str]:
    """JUnit ``classname::name`` -> pytest node ids (``tests/test_x.py::TestA::test_b[p]``), as the
    parser spells them, for the test files on the command line."""
    mods = {f[: -len(".py")].replace("/", "."): f for f in files}
    out = {}
    for tid, o in junit.items():
        cls, _, name = tid.rpartition("::")
        for mod, f in mods.items():
            if cls == mod or cls.startswith(mod + "."):
                inner = cls[len(mod) + 1:].split(".") if cls != mod else []
                out["::".join([f, *inner, name])] = o
                break
    return out


def _passing(o: str | None) -> bool:
    return o in ("passed", "xfailed")


def judge_swebench(ins: Instrumented, log: str, report: dict, status_map: dict[str, str], found: bool,
                   f2p_p2p: list[str], junit_xml: bytes | None, timed_out: bool) -> Verdict:
    """The verdict of one graded run (``report``: swebench's get_eval_report for the instance; ``found``
    and ``status_map``: its get_logs_eval). Never raises on what the run wrote (a raise would end the
    episode as a node error: a discard)."""
    try:
        return _judge(ins, log, report, status_map, found, f2p_p2p, junit_xml, timed_out)
    except Exception as e:  # noqa: BLE001 - see above
        return tampered([f"the evidence could not be read: {type(e).__name__}: {e}"],
                        {"checked": ins.canaries is not None, "parser_found": found})


def _judge(ins: Instrumented, log: str, report: dict, status_map: dict[str, str], found: bool,
           f2p_p2p: list[str], junit_xml: bytes | None, timed_out: bool) -> Verdict:
    codes = exit_codes(log)
    ev: dict = {"checked": ins.canaries is not None, "parser_found": found,
                "exit_status": codes[-1] if codes else None}
    if ins.why:
        ev["why"] = ins.why
    resolved = bool(report.get("resolved"))
    if timed_out:
        return Verdict(TIMED_OUT, 0.0, ["the tests ran past the eval timeout"], ev)
    reasons = []
    if len(codes) > 1:
        reasons.append(f"{len(codes)} '>>>>> Test Exit Code' lines in the log: the eval script writes one")
    parsed = parser_outcomes(status_map) if found else {}
    if found:
        ev["parser"] = count(parsed)
    if ins.canaries is None:
        if reasons:
            return tampered(reasons, ev)
        if not found:
            return Verdict(UNREADABLE, 0.0, ["swebench found no gradable test output in the log"], ev)
        return Verdict(PASSED if resolved else FAILED, 1.0 if resolved else 0.0, [], ev)
    if ins.junit is None:
        return _judge_log_only(ins, report, parsed, found, codes, reasons, ev)
    try:
        structured = junit_outcomes(junit_xml) if junit_xml else None
    except ValueError:
        structured = None
    if structured is None:
        why = "pytest wrote no readable JUnit XML"
        if resolved:  # swebench would pass it on the log alone: the log is what the graded code printed
            return tampered([f"swebench resolved it, but {why}"] + reasons, ev)
        return Verdict(FAILED if found else UNREADABLE, 0.0, [why] + reasons, ev)
    ev["structured"] = count(structured)
    # a test file that does not import runs none of its tests, canaries included: the code's failure
    unloaded = junit_collection_errors(junit_xml)
    if unloaded:
        ev["not_collected"] = unloaded[:5]
    else:
        reasons += [f"JUnit XML: {w}" for w in ins.canaries.check(structured, len(ins.files))]
        if found:
            reasons += [f"parser: {w}" for w in ins.canaries.check(parsed, len(ins.files))]
    if not found:
        reasons.append(f"swebench found no gradable test output in the log, but the JUnit XML holds "
                       f"{len(structured)} results: the log does not describe the run")
    bad = any(o in ("failed", "error") for o in structured.values())
    if codes and (codes[-1] != 0) != bad:
        reasons.append(f"exit status {codes[-1]}, but the JUnit XML {'has' if bad else 'has no'} failures")
    if not codes:
        reasons.append("no '>>>>> Test Exit Code' line in the log: the eval script did not finish as written")
    nodes = junit_nodeids(structured, ins.files)
    differ = [t for t in f2p_p2p if t in nodes and t in parsed and _passing(nodes[t]) != _passing(parsed[t])]
    if differ:
        reasons.append(f"the parser and the JUnit XML disagree on {len(differ)} test(s): {', '.join(differ[:5])}")
    if reasons:
        return tampered(reasons, ev, without_canaries(parsed, ins.canaries))
    return Verdict(PASSED if resolved else FAILED, 1.0 if resolved else 0.0, [], ev)


def _judge_log_only(ins: Instrumented, report: dict, parsed: dict[str, str], found: bool, codes: list[int],
                    reasons: list[str], ev: dict) -> Verdict:
    """A runner that writes no structured result (sympy's, django's): the canaries as the parser read
    them, and the exit status, which the must-fail canary makes non-zero in every honest run."""
    assert ins.canaries is not None
    resolved = bool(report.get("resolved"))
    if not found:
        # nothing shows the tests ran (no structured result): the log is unreadable, a kept 0
        return (tampered(reasons, ev) if reasons else
                Verdict(UNREADABLE, 0.0, ["swebench found no gradable test output in the log"], ev))
    real = without_canaries(parsed, ins.canaries)
    ran = parsed.keys() - real.keys()
    if not ran and not any(_passing(o) for o in real.values()) and not reasons:
        # no canary and no passing test: the test files did not load (the code's failure, as
        # pytest's collection errors), and nothing here reads as a pass: a plain 0, not tampering
        ev["not_collected"] = list(ins.files)[:5]
        return Verdict(FAILED, 0.0, ["no canary and no passing test in the log: the test files did not load"], ev,
                       real)
    reasons += [f"parser: {w}" for w in ins.canaries.check(parsed, len(ins.files))]
    if not codes:
        reasons.append("no '>>>>> Test Exit Code' line in the log: the eval script did not finish as written")
    elif codes[-1] == 0:
        reasons.append("exit status 0, but an honest run fails the must-fail canary: the exit status was forged")
    if reasons:
        return tampered(reasons, ev, real)
    return Verdict(PASSED if resolved else FAILED, 1.0 if resolved else 0.0, [], ev)
