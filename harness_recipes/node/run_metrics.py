"""A rollout's numbers while it runs (``polar-rollout run --report-to tensorboard|wandb``).

At each finished episode (the step: episodes finished so far) the run writes, beside the trainer's
``train/...`` curves when both log to one directory:

- ``rollout/episodes_finished``, ``rollout/episodes_<status>`` (done, error, timeout, ...);
- ``rollout/reward`` (this episode's), ``rollout/reward_mean`` (all finished so far);
- ``rollout/episodes_per_s``, ``rollout/calls``, ``rollout/calls_per_s`` (since the run started);
- ``rollout/call_errors``: call rows with an error and rows of lost calls, so far;
- ``rollout/model_first_byte_s``: the episode's mean time from the proxy receiving a call to the
  server's first byte (queueing and prefill), ``rollout/call_s``: its mean call time through the
  proxy (t_end - t_start; the capture log's timestamps, polar_contracts/log/schema.py).

The calls come from the episode's capture log (its timing columns only); an episode without a
readable log counts no calls.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from harness_recipes.node.tb_events import EventWriter
from polar_contracts.log.table import LogError, read_table

log = logging.getLogger(__name__)

REPORT_TO = ("none", "tensorboard", "wandb")  # the `report_to` backends polar-rollout writes (TRL's names)


def open_writer(report_to: str, logdir: Path, name: str | None = None, config: dict | None = None):
    """The backend's writer (scalars/close) and a line saying where the numbers go; None for "none".
    Raises wandb_run.MetricsBackendError when the backend cannot start (before any episode runs)."""
    if report_to == "none":
        return None, ""
    if report_to == "tensorboard":
        return EventWriter(logdir), f"metrics to TensorBoard in {logdir} (tensorboard --logdir {logdir})"
    if report_to == "wandb":
        from harness_recipes.node.wandb_run import WandbWriter

        w = WandbWriter(logdir, name, config)
        return w, f"metrics to {w.where}"
    raise ValueError(f"report_to {report_to!r} not in {REPORT_TO}")


def call_numbers(path: Path) -> dict[str, float]:
    """An episode log's calls, call errors and mean timings (empty dict: no readable log)."""
    try:
        table, _ = read_table(path, ["kind", "t_start", "t_first_byte", "t_end", "error"])
    except (LogError, OSError) as exc:
        log.debug("no call numbers for %s: %s", path, exc)
        return {}
    rows = table.to_pylist()
    calls = [r for r in rows if r["kind"] == "call"]
    errors = sum(1 for r in rows if r["kind"] == "incomplete" or (r["kind"] == "call" and r["error"]))
    out: dict[str, float] = {"calls": len(calls), "errors": errors}
    first = [r["t_first_byte"] - r["t_start"] for r in calls if r["t_first_byte"] and r["t_start"]]
    whole = [r["t_end"] - r["t_start"] for r in calls if r["t_end"] and r["t_start"]]
    if first:
        out["first_byte_s"] = sum(first) / len(first)
    if whole:
        out["call_s"] = sum(whole) / len(whole)
    return out


class RunMetrics:
    """Pipeline.on_change listener: one step per finished episode (TensorBoard or W&B writer)."""

    def __init__(self, writer, logdir: Path | None):
        self.writer = writer
        self.logdir = logdir
        self.started = time.monotonic()
        self._seen: set[str] = set()
        self.calls = 0
        self.errors = 0

    def update(self, pipeline) -> None:
        for job in pipeline.jobs:
            if job.phase == "finished" and job.eid not in self._seen:
                self._seen.add(job.eid)
                self.episode(job.eid, job.record, pipeline.stats)

    def episode(self, eid: str, record: dict, stats) -> None:
        numbers = call_numbers(self.logdir / f"{eid}.arrow") if self.logdir is not None else {}
        self.calls += int(numbers.get("calls", 0))
        self.errors += int(numbers.get("errors", 0))
        wall = max(time.monotonic() - self.started, 1e-9)
        finished = len(self._seen)
        values = {"rollout/episodes_finished": finished,
                  **{f"rollout/episodes_{s}": n for s, n in sorted(stats.statuses.items())},
                  "rollout/reward": float(record.get("reward") or 0.0),
                  "rollout/reward_mean": sum(stats.rewards) / len(stats.rewards) if stats.rewards else 0.0,
                  "rollout/episodes_per_s": finished / wall,
                  "rollout/calls": self.calls, "rollout/calls_per_s": self.calls / wall,
                  "rollout/call_errors": self.errors}
        if "first_byte_s" in numbers:
            values["rollout/model_first_byte_s"] = numbers["first_byte_s"]
        if "call_s" in numbers:
            values["rollout/call_s"] = numbers["call_s"]
        self.writer.scalars(values, step=finished)

    def close(self) -> None:
        self.writer.close()
