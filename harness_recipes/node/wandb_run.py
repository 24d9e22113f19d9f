"""W&B as a rollout's metrics backend (``polar-rollout run --report-to wandb``).

The same scalars as the TensorBoard writer (harness_recipes/node/run_metrics.py), one W&B step per
finished episode, through the ``wandb`` package the user installs (as TRL's ``report_to wandb`` needs
it too). W&B's own settings apply unchanged: ``WANDB_PROJECT`` (default ``polar-rollout``; TRL's
runs default to ``huggingface``), ``WANDB_ENTITY``, ``WANDB_MODE=offline`` for a machine without
access to a W&B server (``wandb sync`` uploads the run later). The run's files go under
``--logging-dir`` (``DIR/wandb/``).

The run's config names the recipe, tasks and sizes only: no secret, no path to one (W&B uploads it).
"""
from __future__ import annotations

import os
from pathlib import Path

PROJECT = "polar-rollout"


class MetricsBackendError(RuntimeError):
    """The chosen --report-to backend cannot start; the message says what to do."""


class WandbWriter:
    """scalars()/close() like tb_events.EventWriter, into one W&B run."""

    def __init__(self, logdir: str | os.PathLike, name: str | None = None, config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise MetricsBackendError("--report-to wandb needs the wandb package: pip install wandb "
                                      "(or --report-to tensorboard, which needs nothing)") from None
        self.dir = Path(logdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or PROJECT, dir=str(self.dir),
                                  name=name, job_type="rollout", config=config or {})
        except Exception as exc:  # wandb raises its own types (no API key without a tty, server unreachable)
            raise MetricsBackendError(f"--report-to wandb: W&B could not start a run: {exc} (log in with "
                                      f"`wandb login`, or set WANDB_MODE=offline and `wandb sync` later)") from exc
        self.where = f"W&B run {self.run.name} ({self.run.url or 'offline: ' + str(self.dir / 'wandb')})"

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def close(self) -> None:
        self.run.finish()
