"""Official SWE-bench grading of one episode: swebench's own log parser and report, not ours.

In a fresh container of the instance's image (/testbed at base_commit) with only the model patch
applied (node/grading.py: the patch is computed by the node from the agent's file tree, never
through the agent's git, test infrastructure stripped):

1. does test_patch apply to base_commit? (a broken instance is told apart from a model failure);
2. the instance's eval_script runs (reset test files, apply test_patch, tests between the official
   markers), stdout+stderr merged, under the instance's eval timeout; the log is saved;
3. `swebench.harness.grading.get_eval_report` reads that log with the parser the instance names
   (PARSER_REGISTRY) and says FAIL_TO_PASS / PASS_TO_PASS -> resolved; reward 1.0 iff resolved.

4. the verdict (harness_recipes/verdict/swebench.py): swebench's resolved, cross-checked with the
   exit-status line, a JUnit XML and canary tests the eval script is instrumented with; when they
   disagree the verdict is ``tampered`` (reward 0, kept).

Only a failure found before the tests run, outside the graded code, returns an ``error`` (the
episode ends as eval_error and is discarded): test_patch does not apply to base_commit, or the
eval timeout passes before the tests start (the install step hangs). Once the tests ran, what the
log says is the model's: tests that hang are a 0 (``timed_out``), a log swebench reads nothing from
is a 0 (``unreadable``) or ``tampered``, never a discard that would let a failing policy escape its
negative advantage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from harness_recipes.execution import Commands, ExecResult
from harness_recipes.verdict.evidence import Verdict
from harness_recipes.verdict.swebench import instrument_script, judge_swebench

# Polar's bundled instances (data/swebench/), registered in swebench's repo -> parser map at import,
# so swebench resolves their parser exactly as it does its own repos' (its pytest parser).
POLAR_REPOS = ("benjaminp/six", "jpvanhal/inflection", "termcolor/termcolor")


def register_repos() -> None:
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY, parse_log_pytest
    for repo in POLAR_REPOS:
        MAP_REPO_TO_PARSER_PY.setdefault(repo, parse_log_pytest)


def known_parser(name: str) -> bool:
    from swebench.harness.log_parsers import PARSER_REGISTRY
    return name in PARSER_REGISTRY


def parser_for_repo(repo: str) -> str:
    """swebench's parser name for a repo (its MAP_REPO_TO_PARSER_PY), else its pytest parser."""
    from swebench.harness.log_parsers import PARSER_REGISTRY
    from swebench.harness.log_parsers.python import MAP_REPO_TO_PARSER_PY
    register_repos()
    fn = MAP_REPO_TO_PARSER_PY.get(repo)
    if fn is not None:
        for name, f in PARSER_REGISTRY.items():
            if f is fn:
                return name
    return "parse_log_pytest"


@dataclass
class Grade:
    reward: float
    error: str = ""  # non-empty: not the model's doing; the episode is eval_error and discarded
    resolved: bool = False
    report: dict = field(default_factory=dict)  # swebench's report for the instance
    log: ExecResult | None = None
    verdict: Verdict | None = None  # the cross-checked verdict (None: graded before the tests ran)

    def metadata(self) -> dict:
        """The episode record's `swebench`: swebench's per-test lists in full (one copy per episode)."""
        tests = self.report.get("tests_status") or {}
        return {"resolved": self.resolved,
                "patch_successfully_applied": self.report.get("patch_successfully_applied", False),
                "tests": {k: tests[k] for k in ("FAIL_TO_PASS", "PASS_TO_PASS") if k in tests},
                # swebench resolved it, the verdict did not (tampered): both said
                **({"official_resolved": True} if self.report.get("resolved") and not self.resolved else {}),
                **({"error": self.error} if self.error else {})}


def brief_tests(tests: dict) -> dict:
    """Per-test results for the end metadata, which polar-recon copies into EVERY shard row of the
    episode: FAIL_TO_PASS in full (the tests that decide the fix, a handful), PASS_TO_PASS as its
    failures and counts (hundreds of names per instance, kept in full in the episode record and
    report.json)."""
    out = {}
    if "FAIL_TO_PASS" in tests:
        out["FAIL_TO_PASS"] = tests["FAIL_TO_PASS"]
    if "PASS_TO_PASS" in tests:
        p2p = tests["PASS_TO_PASS"]
        out["PASS_TO_PASS"] = {"failure": list(p2p.get("failure", [])), "success_count": len(p2p.get("success", [])),
                               "failure_count": len(p2p.get("failure", []))}
    return out


def test_spec(inst: dict, script: str):
    from swebench.harness.utils import make_test_spec
    return make_test_spec({**inst, "image": inst.get("image") or "", "eval_script": script})


def eval_script_of(inst: dict, sandbox: Commands) -> str:
    """The eval script for the image the sandbox runs (eval_script.script_for: the official one, in the
    official images' conda env or the venv of an image built here)."""
    from harness_recipes.tasks.swebench.eval_script import script_for
    return script_for(inst, getattr(sandbox, "image_path", "") or "built")


def grade_log(inst: dict, model_patch: str, log_path: Path, script: str | None = None) -> dict:
    """swebench's report for one instance from its test log (the official function)."""
    from swebench.harness.grading import get_eval_report
    register_repos()
    pred = {"instance_id": inst["instance_id"], "model_name_or_path": "polar", "model_patch": model_patch}
    spec = test_spec(inst, script or inst["eval_script"])
    return get_eval_report(spec, pred, str(log_path), include_tests_status=True)[inst["instance_id"]]


def logs_eval(inst: dict, log_path: Path, script: str) -> tuple[dict[str, str], bool]:
    """swebench's own reading of the log: (status map, whether it found gradable output)."""
    from swebench.harness.grading import get_logs_eval
    register_repos()
    return get_logs_eval(test_spec(inst, script), str(log_path))


def _text(res: ExecResult) -> str:
    return (res.stdout + res.stderr).decode(errors="replace")


async def grade(inst: dict, sandbox: Commands, env: dict[str, str], timeout: float, outdir: Path,
                model_patch: str) -> Grade:
    """Grade a fresh sandbox (the instance's image, the model patch already applied: node/grading.py)."""
    outdir.mkdir(parents=True, exist_ok=True)
    wd = sandbox.workspace
    base = inst["base_commit"]
    home = sandbox.home
    # The test files are at base_commit here: the model patch never carries them (model_patch.py).
    await sandbox.write_file(f"{home}/test.patch", inst["test_patch"])
    check = await sandbox.exec(["git", "apply", "--check", f"{home}/test.patch"], env, timeout=120, cwd=wd)
    if check.rc != 0:
        return Grade(0.0, f"test_patch does not apply to base_commit {base}: {_text(check)[-400:]}", log=check)

    script = eval_script_of(inst, sandbox)
    ins = instrument_script(script, home)
    if ins.junit is not None:
        # the XML's directory, made here with a random name; writable by the container's root
        # (which holds no CAP_DAC_OVERRIDE) whoever owns the host side
        ins.junit.parent.mkdir(mode=0o733)
        ins.junit.parent.chmod(0o733)
    await sandbox.write_file(f"{home}/eval.sh", ins.script)
    res = await sandbox.exec(["bash", "-c", f"bash {home}/eval.sh 2>&1"], env, timeout=timeout, cwd=wd)
    log_path = outdir / "test_output.txt"
    # as swebench's harness keeps it (exec_run_with_timeout: decode(errors="replace")): its parsers read
    # the log as UTF-8, and a test run may print any bytes (a binary file in `git show`, a test's data)
    log_path.write_text((res.stdout + res.stderr).decode(errors="replace"), encoding="utf-8")
    text = _text(res)
    from swebench.harness.constants import START_TEST_OUTPUT
    if res.timed_out and START_TEST_OUTPUT not in text:
        # the eval script never reached the tests (its install step hung): the node's observation,
        # before any graded code ran
        return Grade(0.0, f"the eval script timed out after {timeout:g}s before the tests started (eval_timeout)",
                     log=res)
    try:
        report = grade_log(inst, model_patch, log_path, script)
        status_map, found = logs_eval(inst, log_path, script)
    except Exception as e:  # noqa: BLE001 - a parser that chokes on what the graded run printed: the
        # run's doing, a 0; raised, it would end the episode as a node error (a discard, an escape)
        report, status_map, found = {"resolved": False, "patch_successfully_applied": False,
                                     "parser_error": f"{type(e).__name__}: {e}"[:300]}, {}, False
    (outdir / "report.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    junit = None
    if ins.junit is not None:
        try:
            junit = ins.junit.read_bytes()
        except OSError:
            junit = None
    verdict = judge_swebench(ins, text, report, status_map, found,
                             list(inst.get("FAIL_TO_PASS") or []) + list(inst.get("PASS_TO_PASS") or []),
                             junit, res.timed_out)
    resolved = bool(report.get("resolved")) and verdict.reward == 1.0
    return Grade(verdict.reward, resolved=resolved, report=report, log=res, verdict=verdict)
