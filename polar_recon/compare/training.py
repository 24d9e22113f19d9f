"""Training curves for `polar-recon compare --trainer [HARNESS=]PATH`: what the trainer logged.

PATH is TRL's ``trainer_state.json`` (its ``log_history``: one dict per logging step; polar-train
writes it into --output_dir at the end, and every checkpoint-N/ holds one), or a directory holding
it (the newest checkpoint-N/ when the top level has none). TensorBoard event files are refused with
a message saying so: reading them needs the tensorboard package, which Polar does not depend on.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

# The curves drawn (every numeric key is kept in the JSON): GRPO's reward, KL and clipping, the
# importance-sampling ratio and its masked / clipped shares (trainer/grpo_trainer.py names them as
# TRL does), the rows and tokens the trainer excluded, the policy lag.
CURVES = ("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "loss",
          "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/min",
          "sampling/importance_sampling_ratio/max", "sampling/importance_sampling_ratio/masked_frac",
          "sampling/importance_sampling_ratio/clipped_frac", "sampling/sampling_logp_difference/mean",
          "clip_ratio/region_mean", "polar/excluded_share", "polar/excluded_tokens_share_total",
          "polar/policy_lag", "completions/mean_length")
# Distributions over the logged steps (the report's "IS ratio and masked-share distributions").
DISTRIBUTIONS = ("sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/masked_frac",
                 "polar/excluded_share", "polar/policy_lag")


class TrainerLogError(ValueError):
    """A --trainer PATH that holds no trainer log this reads; the message names it and why."""


def _state_file(path: Path) -> Path:
    if path.is_file():
        if path.name.startswith("events.out.tfevents") or ".tfevents." in path.name:
            raise TrainerLogError(f"{path}: a TensorBoard event file; reading it needs the tensorboard package "
                                  f"(not a Polar dependency): pass the run's trainer_state.json instead")
        return path
    if not path.is_dir():
        raise TrainerLogError(f"{path}: no such file or directory")
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    ckpts = sorted(path.glob("checkpoint-*/trainer_state.json"),
                   key=lambda p: int(re.sub(r"\D", "", p.parent.name) or 0))
    if ckpts:
        return ckpts[-1]
    if any(path.rglob("*tfevents*")):
        raise TrainerLogError(f"{path}: only TensorBoard event files; reading them needs the tensorboard package "
                              f"(not a Polar dependency): pass the run's trainer_state.json instead")
    raise TrainerLogError(f"{path}: no trainer_state.json (nor checkpoint-*/trainer_state.json)")


def read_history(path: str | Path) -> list[dict[str, Any]]:
    f = _state_file(Path(path))
    try:
        state = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise TrainerLogError(f"{f}: not a JSON trainer state ({exc})") from None
    hist = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(hist, list):
        raise TrainerLogError(f"{f}: no log_history list (is this TRL/transformers' trainer_state.json?)")
    return [h for h in hist if isinstance(h, dict)]


def curves(history: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """{metric: [[step, value], ...]} for every numeric, finite metric of the logging steps."""
    out: dict[str, list[list[float]]] = {}
    for h in history:
        step = h.get("step")
        if not isinstance(step, (int, float)):
            continue
        for k, v in h.items():
            if k in ("step", "epoch") or isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            out.setdefault(k, []).append([float(step), float(v)])
    return out


def summary(c: dict[str, list[list[float]]]) -> dict[str, Any]:
    """Steps logged, first / last value of each curve, and the distributions over steps."""
    def dist(vals: list[float]) -> dict[str, float]:
        s = sorted(vals)
        return {"n": len(s), "min": s[0], "p50": s[len(s) // 2], "max": s[-1], "mean": sum(s) / len(s)}
    steps = sorted({p[0] for v in c.values() for p in v})
    return {"steps": len(steps), "last_step": steps[-1] if steps else None,
            "first": {k: v[0][1] for k, v in c.items() if k in CURVES},
            "last": {k: v[-1][1] for k, v in c.items() if k in CURVES},
            "distributions": {k: dist([p[1] for p in c[k]]) for k in DISTRIBUTIONS if c.get(k)}}


def load_trainers(specs: list[str], harnesses: list[str]) -> dict[str, dict[str, Any]]:
    """{harness: {"path", "curves", "summary"}} of --trainer [HARNESS=]PATH... A PATH without a
    name belongs to the only harness (several harnesses: each PATH must name its own)."""
    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else ("", "", spec)
        if not name:
            if len(harnesses) != 1:
                raise TrainerLogError(f"--trainer {spec}: {len(harnesses)} harnesses in the report "
                                      f"({', '.join(harnesses) or 'none'}); name the one it trained: HARNESS=PATH")
            name = harnesses[0]
        if name in out:
            raise TrainerLogError(f"--trainer {spec}: a second trainer log for {name!r}")
        c = curves(read_history(path))
        out[name] = {"path": str(path), "curves": c, "summary": summary(c)}
    return out
