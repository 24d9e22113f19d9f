"""Grading the agent cannot touch: its file tree out, its sandbox gone, a fresh sandbox graded.

After the harness:
1. the node reads the agent's workspace as files (sandbox.snapshot: docker's archive API, or the
   directory on the host), never through the agent's git, and removes the agent's sandbox: its
   container and every process in it are gone before grading starts;
2. a fresh sandbox (runtime.prepare_grading: a new container of the instance's image, or a fresh
   copy of the task's workspace) gives the pristine tree; the model patch is the difference
   (model_patch.py: computed by a git the agent never configured, test infrastructure stripped);
3. only that patch is applied there (`git apply`; one that does not apply is a graded 0 with that
   reason, the model's doing), then the task's tests run: swebench's eval script and report, or the
   task's eval command;
4. the verdict (harness_recipes/verdict/): the structured result, the exit status, the printed
   summary (swebench's parser) and canary tests planted at grading time must agree; otherwise it
   is `tampered` (reward verdict.evidence.TAMPERED_REWARD, kept in training).

Errors are not an escape: once the model patch applied, whatever the graded run leaves (no output,
garbage, a hang past the eval timeout) is a graded 0 or `tampered`, never a discard. Only what the
node observes outside the graded code discards (``Graded.error``: the task's own test or eval patch
does not apply; an exception here: an image missing, a container that never started, the host's
disk).

What the record gets: `model.patch` in the episode directory, and `eval` metadata with `grading`
(the runtime's: "fresh-container" | "fresh-workspace"), the patch's sha256 and size,
`stripped_paths`, `dropped_paths`, and the verdict: `verdict`, `tampered`, `evidence`
(`verdict_reasons` when it is not plainly passed or failed).

Bounds (file_tree.Budget): the agent's tree, its patch and the time spent reading and diffing are
bounded; crossing one is the agent's doing: a graded 0, kept for training, with `over_budget` (the
reason) in the eval metadata. The pristine tree crossing one is the node's configuration: an error.
"""
from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from harness_recipes.node.model_patch import model_patch, patch_paths
from harness_recipes.runtimes.base import ExecResult, Runtime, Sandbox
from harness_recipes.runtimes.file_tree import Budget, ObjectStore, OverBudget
from harness_recipes.tasks.swebench.grade import brief_tests, grade
from harness_recipes.tasks.task_file import Task
from harness_recipes.verdict.command import Plan, instrument, judge, plan_command, unchecked, workspace_files
from harness_recipes.verdict.evidence import Verdict


@dataclass
class Graded:
    reward: float
    result: ExecResult | None
    error: str  # non-empty: not the model's doing (eval_error, discarded)
    changed: list[str] = field(default_factory=list)
    eval: dict = field(default_factory=dict)  # the end metadata's "eval"
    swebench: dict | None = None  # the record's "swebench" (swebench tasks)


def grading_env(sandbox: Sandbox, base_path: str) -> dict[str, str]:
    return {"PATH": base_path, "LANG": "C.UTF-8", "HOME": sandbox.home, "PYTHONDONTWRITEBYTECODE": "1"}


def test_paths(task: Task) -> set[str]:
    return patch_paths(task.swebench["test_patch"] if task.swebench else task.eval_patch)


def over_budget(runtime: Runtime, task: Task, outdir: Path, why: str) -> Graded:
    """The agent's tree or patch crossed a bound (file_tree.Budget): a graded 0 with the reason, not a discard."""
    (outdir / "model.patch").write_bytes(b"")
    why = why[:500]  # it may name one of the agent's paths
    meta = {"kind": "swebench" if task.swebench else "command", "grading": runtime.grading, "over_budget": why,
            "patch_applied": False, "patch_error": f"over budget: {why}"}
    sw = None
    if task.swebench:
        meta["instance_id"] = task.swebench["instance_id"]
        sw = {"resolved": False, "patch_successfully_applied": False, "tests": {}}
        meta.update(sw)
    return Graded(0.0, None, "", [], meta, sw)


async def grade_episode(runtime: Runtime, task: Task, eid: str, agent: Sandbox, exe: Path, base_path: str,
                        outdir: Path, workdir: str | None = None, budget: Budget | None = None) -> Graded:
    """Grade the episode whose harness ran in ``agent``; closes ``agent`` first."""
    outdir.mkdir(parents=True, exist_ok=True)
    # Model calls the sandbox's forwarder refused (not the harness's: api_socket.py), before it closes.
    refused = agent.api.refused_metadata() if agent.api is not None else None
    g = await _grade(runtime, task, eid, agent, exe, base_path, outdir, workdir, budget)
    if refused is not None:
        g.eval["model_api"] = refused
    return g


async def _grade(runtime: Runtime, task: Task, eid: str, agent: Sandbox, exe: Path, base_path: str,
                 outdir: Path, workdir: str | None, budget: Budget | None) -> Graded:
    # Absolute: the object store's git runs in other working directories, where a relative
    # --out (as the docs write it) would name another place.
    tmp = Path(tempfile.mkdtemp(prefix=f"polar-grade-{eid}-", dir=Path(workdir).resolve() if workdir else None))
    try:
        store = await asyncio.to_thread(ObjectStore, tmp / "objects.git", budget)
        try:
            theirs = await agent.snapshot(store)
        except OverBudget as e:
            await agent.close()
            return over_budget(runtime, task, outdir, str(e))
        await agent.close()
        fresh = await runtime.prepare_grading(task, f"{eid}.grade", exe)
        try:
            store.restart_clock()  # the bound is on reading and diffing, not on starting the grading sandbox
            return await _grade_fresh(runtime, task, fresh, store, theirs, base_path, outdir)
        except OverBudget as e:
            return over_budget(runtime, task, outdir, str(e))
        finally:
            await fresh.close()
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)


async def _grade_fresh(runtime: Runtime, task: Task, fresh: Sandbox, store: ObjectStore, theirs, base_path: str,
                       outdir: Path) -> Graded:
    try:
        pristine = await fresh.snapshot(store)
    except OverBudget as e:  # the node's own tree: its budget is too small for the task, not the agent's doing
        raise RuntimeError(f"the task's pristine tree is over the grading budget ({e}): raise --grading-budget") from None
    # how the eval command is instrumented: decided on the pristine tree, so the patch cannot delete a
    # test file to have its run graded by the exit status alone
    plan = None if task.swebench else plan_command(
        task.eval_cmd, workspace_files(Path(fresh.workspace), patch_paths(task.eval_patch)))
    mp = await asyncio.to_thread(model_patch, store, pristine, theirs, test_paths(task))
    (outdir / "model.patch").write_bytes(mp.patch)
    meta = {"kind": "swebench" if task.swebench else "command", "grading": runtime.grading, **mp.metadata()}
    if task.swebench:
        meta["instance_id"] = task.swebench["instance_id"]
        # which image graded it: an official one (its conda env) or one built here (image_path)
        meta.update(image=getattr(fresh, "image", ""), image_path=getattr(fresh, "image_path", ""))
    env = grading_env(fresh, base_path)
    if mp.patch:
        await fresh.write_bytes(f"{fresh.home}/model.patch", mp.patch)
        applied = await fresh.exec(["git", "apply", "--binary", "--whitespace=nowarn", f"{fresh.home}/model.patch"],
                                   env, timeout=120, cwd=fresh.workspace)
        if applied.rc != 0:
            # The node computed the patch against this very tree; should it still not apply, that is
            # the model's tree (e.g. a path beyond a symlink), graded 0 and kept.
            why = (applied.stdout + applied.stderr).decode(errors="replace")[-400:]
            meta.update(patch_applied=False, patch_error=why, verdict="failed", tampered=False)
            sw = {"resolved": False, "patch_successfully_applied": False, "tests": {}} if task.swebench else None
            if sw is not None:
                meta.update(sw)
                sw.update(image=meta["image"], image_path=meta["image_path"])
            return Graded(0.0, applied, "", mp.changed, meta, sw)
    meta["patch_applied"] = True
    if task.swebench:
        g = await grade(task.swebench, fresh, env, task.eval_timeout, outdir, mp.patch.decode(errors="replace"))
        sw = g.metadata()
        # the record keeps swebench's lists in full; the end metadata (copied into every shard row) briefly
        meta.update({**sw, "tests": brief_tests(sw["tests"])})
        if g.verdict is not None:
            meta.update(g.verdict.metadata())
        sw.update(image=meta["image"], image_path=meta["image_path"])
        return Graded(g.reward, g.log, g.error, mp.changed, meta, sw)
    verdict, res, err = await evaluate_task(task, fresh, env, plan)
    if verdict is not None:
        meta.update(verdict.metadata())
        if verdict.tests:
            meta["tests"] = brief_outcomes(verdict.tests)
    return Graded(verdict.reward if verdict else 0.0, res, err, mp.changed, meta)


def brief_outcomes(tests: dict[str, str]) -> dict:
    """A command task's real tests for the end metadata (copied into every shard row): the ones that
    did not pass by name, the rest counted."""
    bad = sorted(t for t, o in tests.items() if o not in ("passed", "xfailed"))
    return {"failure": bad[:50], "success_count": len(tests) - len(bad), "failure_count": len(bad)}


async def evaluate_task(task: Task, sandbox: Sandbox, env: dict[str, str],
                        plan: Plan) -> tuple[Verdict | None, ExecResult | None, str]:
    """A task-file task: its eval patch (tests the agent never saw), then its eval command, instrumented
    as ``plan`` says (verdict/command.py). A non-empty error: the task's eval patch does not apply (the
    task's fault, found before any graded code ran), the only discard here."""
    if task.eval_patch:
        await sandbox.write_file(f"{sandbox.home}/eval.patch", task.eval_patch)
        res = await sandbox.exec(["git", "apply", f"{sandbox.home}/eval.patch"], env, timeout=60, cwd=sandbox.workspace)
        if res.rc != 0:
            return None, res, f"eval patch did not apply: {res.stderr.decode(errors='replace')[-300:]}"
    if not plan.checked:
        res = await sandbox.exec(["bash", "-c", task.eval_cmd], env, timeout=task.eval_timeout, cwd=sandbox.workspace)
        return unchecked(res, plan.why), res, ""
    ins = await instrument(plan, task.eval_cmd, sandbox)
    res = await sandbox.exec(["bash", "-c", ins.command], env, timeout=task.eval_timeout, cwd=sandbox.workspace)
    return judge(plan.mode, ins, res), res, ""


async def evaluate_command(task: Task, sandbox: Sandbox, env: dict[str, str]) -> tuple[float, ExecResult | None, str]:
    """A task-file task graded in ``sandbox`` (its workspace as prepared, no model patch to apply):
    (reward, the eval's result, error); evaluate_task with the plan read from the workspace."""
    plan = plan_command(task.eval_cmd, workspace_files(Path(sandbox.workspace), patch_paths(task.eval_patch)))
    verdict, res, err = await evaluate_task(task, sandbox, env, plan)
    return (verdict.reward if verdict else 0.0), res, err
