"""The verdict of a task-file task: its eval command, run through Polar's runner with canaries planted.

What evidence a command task gives depends on its eval command:
- it runs ``python -m unittest ARGS`` or ``python -m pytest ARGS`` (once) on named test files
  (``test_calc``, ``pkg.tests.test_x``, ``tests/test_x.py``, ``tests/test_x.py::TestX``): the node
  runs that invocation through runner.py instead (the rest of the command is left as it is), with
  a canary class planted in each named test file, and requires the structured result, the exit
  status, the printed summary and the canaries to agree (``checked``);
- anything else (another language's runner, discovery without a named file, ``-k`` / pytest ``-m``
  selections, which could deselect the canaries): the exit status alone, 0 -> 1.0, recorded as
  ``verdict: unchecked`` on every episode so the shards say the reward can be forged from inside
  the code under test. docs/security.md says how to write a checked task.
"""
from __future__ import annotations

import json
import re
import secrets
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from harness_recipes.execution import Commands, ExecResult
from harness_recipes.verdict.canaries import Canaries, without_canaries
from harness_recipes.verdict.evidence import (
    FAILED,
    PASSED,
    TIMED_OUT,
    UNCHECKED,
    UNREADABLE,
    Verdict,
    all_passed,
    count,
    junit_collection_errors,
    junit_outcomes,
    pytest_summary,
    tampered,
    unittest_summary,
)

# `python -m unittest` / `python3.11 -m pytest` / `/venv/bin/python -m pytest`, as a shell word
INVOCATION = re.compile(r"(?:^|(?<=[\s;&|(]))(?P<py>[\w./+-]*python[\d.]*)\s+-m\s+(?P<mode>unittest|pytest)(?=\s|$)")
SHELL_END = re.compile(r"&&|\|\||[;|&\n)<>]")
# options that take the next word as their value (so it is not read as a test target)
VALUE_OPTIONS = {"unittest": {"-k", "-p", "-s", "-t"},
                 "pytest": {"-k", "-m", "-p", "-o", "-c", "-W", "--rootdir", "--deselect", "--ignore", "--confcutdir",
                            "--junitxml", "--junit-xml", "--basetemp", "-n", "--maxfail", "--tb", "-r"}}
# options that select tests by expression: the canaries could be deselected, so the run is unchecked
SELECTING = {"unittest": {"-k"}, "pytest": {"-k", "-m", "--deselect", "--lf", "--last-failed", "--sw", "--stepwise"}}
CHDIR = re.compile(r"(?:^|[\s;&|(])(?:cd|pushd)(?=\s|$)")
# options that stop at the first failure: the canaries (last in their file) may never run
FAILFAST = {"unittest": {"-f", "--failfast"}, "pytest": {"-x", "--exitfirst", "--maxfail"}}
FAILFAST_LETTER = {"unittest": "f", "pytest": "x"}
MODULE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


@dataclass(frozen=True)
class Plan:
    """How a command task's eval is instrumented (or why it is not: ``why``)."""

    mode: str = ""  # unittest | pytest
    span: tuple[int, int] = (0, 0)  # of `PY -m MODE` in the eval command
    python: str = ""
    files: tuple[str, ...] = ()  # test files the canaries go in
    # test files named only in part: (file, how the canary class is named on the command line;
    # "{cls}" is replaced with the class)
    targets: tuple[tuple[str, str], ...] = ()
    why: str = ""  # non-empty: not instrumented, graded by the exit status alone

    @property
    def checked(self) -> bool:
        return not self.why


def _targets(mode: str, words: list[str], exists: Callable[[str], bool]) -> tuple[list[str], list[tuple[str, str]]]:
    whole: list[str] = []
    part: list[tuple[str, str]] = []
    skip = False
    for w in words:
        if skip:
            skip = False
            continue
        if w.startswith("-"):
            skip = w in VALUE_OPTIONS[mode]
            continue
        path, _, rest = w.partition("::")
        if path.endswith(".py") and exists(path):
            if rest:
                part.append((path, f"{path}::{{cls}}" if mode == "pytest" else ""))
            else:
                whole.append(path)
            continue
        if mode == "unittest" and MODULE.match(w):
            names = w.split(".")
            for n in range(len(names), 0, -1):  # the longest prefix that is a file: the module
                rel = "/".join(names[:n]) + ".py"
                if exists(rel):
                    if n == len(names):
                        whole.append(rel)
                    else:
                        part.append((rel, ".".join(names[:n]) + ".{cls}"))
                    break
    part = [(p, t) for p, t in part if p not in whole]
    return whole, part


def plan_command(eval_cmd: str, exists: Callable[[str], bool]) -> Plan:
    """Find the test invocation in ``eval_cmd``; ``exists(rel)``: whether the pristine workspace (or the
    eval patch) holds that regular file."""
    found = list(INVOCATION.finditer(eval_cmd))
    if len(found) != 1:
        return Plan(why=f"the eval command runs {'no' if not found else len(found)} `python -m unittest|pytest`"
                        " invocation(s); exactly one is instrumented")
    m = found[0]
    mode = m.group("mode")
    if CHDIR.search(eval_cmd[: m.start()]):
        return Plan(why="the eval command changes directory before its tests: their files are not read from the root")
    tail = eval_cmd[m.end():]
    stop = SHELL_END.search(tail)
    try:
        words = shlex.split(tail[: stop.start()] if stop else tail)
    except ValueError as e:
        return Plan(why=f"cannot read the test runner's arguments: {e}")
    if "discover" in words[:1]:
        return Plan(why="unittest discovery names no test file to plant the canaries in")
    sel = sorted(SELECTING[mode].intersection(w.split("=", 1)[0] for w in words))
    if sel:
        return Plan(why=f"{' '.join(sel)} selects tests by expression: the canaries could be deselected")
    # failfast, also inside a cluster of short flags (-qx); a cluster led by an option taking a value
    # (-rxs: -r's value) is read as one too: unchecked, the safe side
    stop_first = [w for w in words if w.split("=", 1)[0] in FAILFAST[mode]
                  or (re.fullmatch(r"-[A-Za-z]{2,}", w) and FAILFAST_LETTER[mode] in w)]
    if stop_first:
        return Plan(why=f"{stop_first[0]} stops at the first failure: the canaries may not run")
    whole, part = _targets(mode, words, exists)
    if not whole and not part:
        return Plan(why="the test runner is given no test file of the workspace to plant the canaries in")
    if mode == "unittest" and any(not t for _, t in part):
        return Plan(why="`python -m unittest FILE.py::NAME` is not a unittest target")
    return Plan(mode, m.span(), m.group("py"), tuple(dict.fromkeys(whole + [p for p, _ in part])), tuple(part))


def workspace_files(root: Path, extra: set[str]) -> Callable[[str], bool]:
    """``exists`` for plan_command: a regular file (not a link) below ``root``, or one of ``extra``."""
    base = root.resolve()

    def exists(rel: str) -> bool:
        if rel in extra:
            return True
        p = root / rel
        try:
            return p.resolve().is_relative_to(base) and p.is_file() and not p.is_symlink()
        except OSError:
            return False
    return exists


@dataclass
class Instrumented:
    command: str
    canaries: Canaries
    result: Path
    junit: Path
    files: tuple[str, ...] = field(default_factory=tuple)


async def instrument(plan: Plan, eval_cmd: str, sandbox: Commands) -> Instrumented:
    """The eval command with its test invocation run by runner.py, and the files it needs, written into
    a directory the node creates under the sandbox's home (outside the workspace) with a random name."""
    can = Canaries.draw()
    d = Path(sandbox.home) / f".polar-{secrets.token_hex(8)}"
    runner, spec = d / f"{secrets.token_hex(8)}.py", d / f"{secrets.token_hex(8)}.json"
    result, junit = d / f"{secrets.token_hex(8)}.out", d / f"{secrets.token_hex(8)}.xml"
    await sandbox.write_file(str(runner), files("harness_recipes.verdict").joinpath("runner.py").read_text())
    body = {"result": str(result), "junit": str(junit), "plant": list(plan.files), "block": can.block(),
            "targets": [[rel, t.format(cls=can.cls)] for rel, t in plan.targets]}
    await sandbox.write_file(str(spec), json.dumps(body))
    # writable by a container's root (no CAP_DAC_OVERRIDE) whoever owns the host side; not listable
    d.chmod(0o733)
    start, end = plan.span
    run = (f"{plan.python} -c {shlex.quote(f'exec(open({str(runner)!r}).read())')} {shlex.quote(str(spec))} "
           f"{plan.mode}")
    return Instrumented(eval_cmd[:start] + run + eval_cmd[end:], can, result, junit, plan.files)


def _read(p: Path) -> bytes | None:
    try:
        return p.read_bytes()
    except OSError:
        return None


def _valid(record) -> bool:
    """The runner's record as the runner writes it; anything else was written by someone else."""
    if not (isinstance(record, dict) and isinstance(record.get("exit"), int)
            and isinstance(record.get("planted"), list) and all(isinstance(p, str) for p in record["planted"])):
        return False
    tests, events = record.get("tests"), record.get("events")
    return ((tests is None or (isinstance(tests, dict) and all(isinstance(o, str) for o in tests.values())))
            and (events is None or (isinstance(events, dict) and all(isinstance(v, int) for v in events.values())))
            and isinstance(record.get("load_error"), (str, type(None))))


def judge(mode: str, ins: Instrumented, res: ExecResult) -> Verdict:
    """The verdict of one instrumented run from its result file, JUnit XML, exit status and output.
    Never raises on what the graded run wrote: an exception here would end the episode as a node
    error, a discard, which is the escape this module closes."""
    try:
        return _judge(mode, ins, res)
    except Exception as e:  # noqa: BLE001 - see above
        return tampered([f"the evidence could not be read: {type(e).__name__}: {e}"],
                        {"checked": True, "runner": mode, "exit_status": res.rc})


def _judge(mode: str, ins: Instrumented, res: ExecResult) -> Verdict:
    text = (res.stdout + res.stderr).decode(errors="replace")
    ev: dict = {"checked": True, "runner": mode, "exit_status": res.rc}
    if res.timed_out:
        return Verdict(TIMED_OUT, 0.0, ["the tests ran past the eval timeout"], ev)
    raw = _read(ins.result)
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        record = None
    if record is not None and not _valid(record):
        return tampered(["the runner's record is not one the runner writes"], ev)
    if record is None:
        if res.rc == 0:
            return tampered(["exit status 0, but the runner wrote no result: the run ended before its tests did"], ev)
        return Verdict(UNREADABLE, 0.0, ["the runner wrote no result (the graded code crashed or exited first)"], ev)
    xml = None
    if mode == "unittest":
        tests = record.get("tests")
        if not isinstance(tests, dict):
            return tampered(["the runner's record holds no test outcomes"], ev)
        where = "unittest result"
    else:
        xml = _read(ins.junit)
        try:
            tests = junit_outcomes(xml or b"")
        except ValueError as e:
            why = f"pytest's JUnit XML is unreadable ({e})"
            return tampered([why], ev) if res.rc == 0 or record["exit"] == 0 else Verdict(UNREADABLE, 0.0, [why], ev)
        where = "JUnit XML"
    ev.update(runner_exit=record["exit"], structured=count(tests), planted=len(record["planted"]))
    # a test module that does not import runs none of its tests, canaries included: the code's failure
    unloaded = ([record["load_error"]] if record.get("load_error") else
                junit_collection_errors(xml or b"") if mode == "pytest" else
                [t for t in tests if t.startswith(("unittest.loader._FailedTest", "unittest.loader.ModuleImportFailure"))])
    reasons = [] if unloaded else ins.canaries.check(tests, len(record["planted"]))
    if res.rc != record["exit"]:
        reasons.append(f"exit status {res.rc}, but the test framework returned {record['exit']}")
    bad = any(o in ("failed", "error") for o in tests.values())
    if bad != (record["exit"] != 0):
        reasons.append(f"the {where} {'has' if bad else 'has no'} failures, the framework returned {record['exit']}")
    reasons += _summary_disagrees(mode, text, tests, ev, record.get("events"))
    real = without_canaries(tests, ins.canaries)
    if reasons:
        return tampered(reasons, ev, real)
    if unloaded:
        return Verdict(FAILED, 0.0, [f"the tests did not load: {', '.join(map(str, unloaded))[:300]}"], ev, real)
    missing = sorted(set(ins.files) - set(record["planted"]))
    if missing:
        return Verdict(FAILED, 0.0, [f"test file(s) missing when the tests ran: {', '.join(missing)}"], ev, real)
    ok = all_passed(real)
    return Verdict(PASSED if ok else FAILED, 1.0 if ok else 0.0, [], ev, real)


def _summary_disagrees(mode: str, text: str, tests: dict[str, str], ev: dict, events: dict | None) -> list[str]:
    """The printed summary against the structured result. Absent (the eval command sent the output
    elsewhere): recorded, no disagreement. Printed twice: someone printed one."""
    c = count(tests)
    if mode == "unittest":
        sums = unittest_summary(text)
        ev["summary"] = sums[-1] if len(sums) == 1 else len(sums)
        if len(sums) > 1:
            return [f"{len(sums)} unittest summaries printed"]
        if not sums:
            return []
        s = sums[0]
        bad = any(o in ("failed", "error", "xpassed") for o in tests.values())
        # failures / errors as unittest counts them (a failing subtest each), recorded by the runner
        # and those counts against the outcomes: one event per failing test, more only from subtests
        n_bad = sum(o in ("failed", "error") for o in tests.values())
        counted = (isinstance(events, dict) and all(s.get(k, 0) == events.get(k) for k in ("failures", "errors"))
                   and (s.get("failures", 0) + s.get("errors", 0) == n_bad if not events.get("subtests")
                        else s.get("failures", 0) + s.get("errors", 0) >= n_bad))
        if s["ran"] != len(tests) or s["ok"] == bad or not counted:
            return [f"the printed summary {s} disagrees with the unittest result {c} ({events})"]
        return []
    sums = pytest_summary(text)
    ev["summary"] = sums[-1] if len(sums) == 1 else len(sums)
    if len(sums) > 1:
        return [f"{len(sums)} pytest summaries printed"]
    if sums and any(sums[0].get(k, 0) != c.get(k, 0) for k in ("passed", "failed")):
        return [f"the printed summary {sums[0]} disagrees with the JUnit XML {c}"]
    return []


def unchecked(res: ExecResult, why: str) -> Verdict:
    """An eval the node cannot instrument: the exit status alone (forgeable from inside; recorded)."""
    ev = {"checked": False, "why": why, "exit_status": res.rc}
    if res.timed_out:
        return Verdict(TIMED_OUT, 0.0, ["the eval command ran past the eval timeout"], ev)
    return Verdict(UNCHECKED, 1.0 if res.rc == 0 else 0.0, [], ev)
