"""The pipelined scheduler: prewarm -> run harness -> evaluate + end -> hand to reconstruction.

Each episode is one coroutine walking the four phases; each phase has its own concurrency limit
(an asyncio.Semaphore), so while episode N is evaluated, N+1 runs and N+2 prewarms. An admission
gate of size run+prewarm bounds how many workspaces are prepared ahead of a free harness slot.
`sequential=True` runs one episode through all phases before the next starts (the baseline the
benchmark compares against).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import harness_recipes.node.episode as ep
from harness_recipes.node.grading import grade_episode
from harness_recipes.node.records import Records
from harness_recipes.node.upstream import log_upstream_failure
from harness_recipes.recipes.recipe import Recipe
from harness_recipes.runtimes.base import Runtime, Sandbox
from harness_recipes.runtimes.limits import LimitHit
from harness_recipes.tasks.task_file import Task
from polar_contracts.log import end_record as end
from polar_contracts.log.end_record import read_head
from polar_contracts.log.table import LogError

PHASES = ("queued", "prewarm", "run", "eval", "recon", "finished")


@dataclass
class Limits:
    prewarm: int = 2
    run: int = 2
    eval: int = 2
    recon: int = 1
    sequential: bool = False

    def __post_init__(self):
        for name in ("prewarm", "run", "eval", "recon"):
            if getattr(self, name) < 1:
                raise ValueError(f"concurrency limit {name} must be at least 1")


@dataclass
class Job:
    task: Task
    sample: int
    attempt: int
    eid: str
    phase: str = "queued"
    record: dict = field(default_factory=dict)


@dataclass
class Stats:
    """Numbers for the progress view and the benchmark."""

    started: float = field(default_factory=time.monotonic)
    phase_counts: dict[str, int] = field(default_factory=lambda: {p: 0 for p in PHASES})
    statuses: dict[str, int] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    run_busy: float = 0.0  # harness-slot seconds in use (the proxy/GPU side is busy only then)
    finished: int = 0
    skipped: int = 0

    def move(self, old: str, new: str) -> None:
        self.phase_counts[old] -= 1
        self.phase_counts[new] += 1

    def wall(self) -> float:
        return time.monotonic() - self.started


class Pipeline:
    def __init__(self, recipe: Recipe, exe: Path, runtime: Runtime, settings: ep.Settings, records: Records,
                 logdir: Path | None, limits: Limits, on_change: Callable[[Pipeline], None] | None = None,
                 log_wait: float = 5.0, link_logs: bool = False):
        self.recipe, self.exe, self.runtime, self.settings = recipe, exe, runtime, settings
        # link each handed-off log into the records' logs/ (`run`: what its --recon builds)
        self.link_logs = link_logs
        self.records, self.logdir, self.limits = records, logdir, limits
        self.on_change = on_change or (lambda p: None)
        self.log_wait = log_wait
        self.stats = Stats()
        seq = limits.sequential
        self._gate = asyncio.Semaphore(1 if seq else limits.run + limits.prewarm)
        self._sem = {name: asyncio.Semaphore(1 if seq else getattr(limits, name))
                     for name in ("prewarm", "run", "eval", "recon")}
        self._whole = asyncio.Lock() if seq else None
        self.jobs: list[Job] = []

    def plan(self, tasks: list[Task], samples: int) -> list[Job]:
        """Every (task, sample) not finished already; samples interleaved so groups fill evenly."""
        jobs = []
        for sample in range(samples):
            for task in tasks:
                if self.records.finished(task.id, sample):
                    self.stats.skipped += 1
                    continue
                attempt = self._free_attempt(task.id, sample, self.records.next_attempt(task.id, sample))
                jobs.append(Job(task, sample, attempt, ep.episode_id(task.id, sample, attempt)))
        self.jobs = jobs
        self.stats.phase_counts["queued"] = len(jobs)
        return jobs

    def _free_attempt(self, task_id: str, sample: int, attempt: int) -> int:
        """The first attempt from ``attempt`` whose episode has no log in LOGDIR yet. A log there that
        this OUT does not record is another run's over the same proxy logdir: its episode may have
        ended already (the proxy refuses its calls), so this run never reuses its id."""
        while self.logdir is not None and (self.logdir / f"{ep.episode_id(task_id, sample, attempt)}.arrow").exists():
            attempt += 1
        return attempt

    def start(self, job: Job) -> asyncio.Task:
        """Run one more job while the pipeline runs (a fleet node pulls its jobs from a shared
        queue instead of planning them all up front); the task ends once the job is recorded."""
        self.jobs.append(job)
        self.stats.phase_counts["queued"] += 1
        return asyncio.create_task(self._episode(job), name=job.eid)

    async def run(self) -> list[dict]:
        tasks = [asyncio.create_task(self._episode(job), name=job.eid) for job in self.jobs]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            # A cancelled gather has already cancelled each episode once; cancelling again would cut
            # their cleanup short. Let every episode kill, close and record before we return.
            for t in tasks:
                if not t.done() and not t.cancelling():
                    t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [j.record for j in self.jobs]

    @contextlib.asynccontextmanager
    async def _phase(self, job: Job, name: str):
        async with self._sem[name]:
            self.stats.move(job.phase, name)
            job.phase = name
            self.on_change(self)
            t0, w0 = time.monotonic(), time.time()
            try:
                yield
            finally:
                # Wall-clock start/end per phase: shows the overlap between episodes.
                job.record.setdefault("phases", {})[name] = [round(w0, 4), round(time.time(), 4)]
                if name == "run":
                    self.stats.run_busy += time.monotonic() - t0

    async def _episode(self, job: Job) -> None:
        if self._whole is not None:
            async with self._whole:
                await self._episode_inner(job)
        else:
            await self._episode_inner(job)

    async def _episode_inner(self, job: Job) -> None:
        rec = job.record
        rec.update(episode_id=job.eid, task_id=job.task.id, sample=job.sample, attempt=job.attempt,
                   harness=self.recipe.name, runtime=self.runtime.name, group_id=job.task.id)
        sandbox: Sandbox | None = None
        try:
            async with self._gate:
                async with self._phase(job, "prewarm"):
                    sandbox = await self.runtime.prepare(job.task, job.eid, self.exe,
                                                         upstream=self.settings.proxy_for(job.eid))
                    values = self._values(job, sandbox)
                    await ep.write_config(self.recipe, sandbox, values, self.settings)
                async with self._phase(job, "run"):
                    env = ep.harness_env(self.recipe, values, self.settings, self._node_dir(sandbox))
                    res = await ep.run_harness(self.recipe, sandbox, values, env, job.task.timeout, self.settings)
                self._note_harness(job, res)
                await self._check_upstream(job)
            async with self._phase(job, "eval"):
                await self._evaluate(job, sandbox)
            await sandbox.close()
            sandbox = None
            async with self._phase(job, "recon"):
                await self._handoff(job)
        except asyncio.CancelledError:
            rec.update(status=ep.INTERRUPTED, reward=0.0, error="interrupted (Ctrl-C or shutdown)")
            await self._end_quietly(job)
            raise
        except LimitHit as e:  # the sandbox was stopped at a limit and could not be read afterwards
            rec.update(status=ep.RESOURCE_LIMIT, reward=0.0, error=e.reason)
            await self._end_quietly(job)
        except Exception as e:  # an infrastructure failure: record it, keep the other episodes going
            rec.update(status=ep.ERROR, reward=0.0, error=f"{type(e).__name__}: {e}"[:2000])
            await self._end_quietly(job)
        finally:
            try:
                if sandbox is not None:
                    await asyncio.shield(sandbox.close())
            finally:
                self._finish(job)  # recorded whatever happened, even if the close was interrupted

    def _values(self, job: Job, sandbox: Sandbox) -> dict[str, str]:
        view = getattr(sandbox, "exe_view", None)
        return ep.episode_vars(self.recipe, self.exe, sandbox, job.task, job.eid, self.settings, exe_view=view)

    def _node_dir(self, sandbox: Sandbox) -> str | None:
        return getattr(sandbox, "node_dir", None) or ep.node_dir()

    def _note_harness(self, job: Job, res) -> None:
        job.record.update(status=ep.harness_status(res), harness_rc=res.rc, harness_seconds=round(res.seconds, 3),
                          harness_stderr_tail=ep.tail(res.stderr))
        if res.limit:  # which limit, and how far it went (resource_limit)
            job.record["error"] = res.limit
        ep.save_output(self.records.episode_dir(job.eid), "harness", res)

    async def _check_upstream(self, job: Job) -> None:
        """An episode whose every model call the server refused (a wrong model name, the server
        down behind the proxy) is an infrastructure error with the server's message, not a graded 0."""
        if self.logdir is None:
            return
        err = await asyncio.to_thread(log_upstream_failure, self.logdir / f"{job.eid}.arrow")
        if err:
            raise RuntimeError(err)

    async def _evaluate(self, job: Job, sandbox: Sandbox) -> None:
        rec = job.record
        edir = self.records.episode_dir(job.eid)
        # grading.py: the agent's tree read as files, its sandbox closed, a fresh one graded.
        g = await grade_episode(self.runtime, job.task, job.eid, sandbox, self.exe, self.settings.base_path, edir,
                                workdir=getattr(self.runtime, "workdir", None), budget=self.settings.grading_budget)
        rec["changed_files"] = g.changed
        rec["eval"] = g.eval
        if g.swebench is not None:
            rec["swebench"] = g.swebench
        ep.save_output(edir, "eval", g.result)
        rec.update(reward=g.reward, eval_rc=g.result.rc if g.result else None)
        if g.error:
            rec.update(status=ep.EVAL_ERROR, error=g.error)
        end_err = await ep.post_end(self.settings.proxy_for(job.eid), job.eid, g.reward, self._metadata(job),
                                    secret=self.settings.control_secret)
        if end_err:
            # Without the end row the episode never counts as finished for reconstruction.
            raise RuntimeError(end_err)

    def _metadata(self, job: Job) -> dict:
        r = job.record
        # discard: an episode cut short by us (not by the agent) is no training signal. One that could
        # not be graded (eval_error: the test patch does not apply, the tests hang, no test output) is
        # not one either: its reward 0 would read as the model's failure.
        discard = r.get("status") in (ep.ERROR, ep.INTERRUPTED, ep.EVAL_ERROR)
        meta = {end.TASK_ID: job.task.id, end.SAMPLE: job.sample, end.GROUP_ID: job.task.id,
                end.HARNESS: self.recipe.name, end.STATUS: r.get("status"), end.DISCARD: discard,
                # how the harness was confined: none marks an unsandboxed episode on every row
                end.ISOLATION: self.runtime.isolation,
                # whether the proxy's control plane was secured (open: the agent could end episodes)
                end.CONTROL_PLANE: self.settings.control_mark()}
        if self.recipe.auxiliary:
            # how this harness's auxiliary calls look (a title call, ...): the log reader flags them so
            # they are never trained with the episode's reward (polar_contracts/auxiliary.py)
            meta[end.AUXILIARY_RULES] = [{"name": a.name, "match": dict(a.match)} for a in self.recipe.auxiliary]
        if r.get("error"):
            meta[end.REASON] = r["error"][:500]
        if "eval" in r:
            # "eval": how it was graded and what the evaluation found beyond the reward (grading.py);
            # polar-recon copies it into the shards.
            meta[end.EVAL] = r["eval"]
        return meta

    async def _end_quietly(self, job: Job) -> None:
        if job.phase in ("queued", "prewarm"):
            return  # the harness never ran: there is no capture log to close
        with contextlib.suppress(BaseException):
            await asyncio.shield(ep.post_end(self.settings.proxy_for(job.eid), job.eid, 0.0, self._metadata(job),
                                             timeout=3.0, secret=self.settings.control_secret))

    async def _handoff(self, job: Job) -> None:
        """Check the capture log is complete before it is counted as ready for reconstruction.

        Polls the log's end record only (end_record.read_head: the last batch, no prompt decoded),
        never the whole episode: the proxy may still be writing, and a long episode costs its
        full decode per poll otherwise."""
        if self.logdir is None:
            return
        path = self.logdir / f"{job.eid}.arrow"
        deadline = time.monotonic() + self.log_wait
        while True:
            try:
                head = await asyncio.to_thread(read_head, path)
                if head.finished or time.monotonic() > deadline:
                    break
            except LogError:
                if time.monotonic() > deadline:
                    job.record.update(n_calls=0, log_finished=False, log_note=f"no capture log at {path}")
                    return
            await asyncio.sleep(0.1)
        job.record.update(n_calls=head.n_calls, log_finished=head.finished)
        if self.link_logs:
            self.records.link_log(path)

    def _finish(self, job: Job) -> None:
        rec = job.record
        rec.setdefault("status", ep.ERROR)
        rec.setdefault("reward", 0.0)
        rec["finished_at"] = time.time()
        self.records.append(rec)
        self.stats.move(job.phase, "finished")
        job.phase = "finished"
        self.stats.finished += 1
        self.stats.statuses[rec["status"]] = self.stats.statuses.get(rec["status"], 0) + 1
        self.stats.rewards.append(float(rec["reward"]))
        self.on_change(self)
