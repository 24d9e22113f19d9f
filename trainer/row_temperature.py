"""Which temperature the server sampled a shard row with, and the check that the trainer uses it.

The behaviour logprobs in a shard are the server's processed logprobs: log-softmax of the logits
divided by the sampling temperature. TRL computes the policy's logprobs with its own
``temperature``. When the two differ, every importance ratio measures the temperature gap, not
the policy's staleness (the demo's 0.25 nat/token: Pi sends no temperature, so the server applied
its model's generation_config.json default of 0.6 while the trainer used TRL's 1.0, and
``sequence_mask`` dropped every sequence).

polar-recon records each row's requested temperature (``temperature``; null: the request set none).
A null is resolved the way vLLM and SGLang resolve it: the served model's generation_config.json
default, else 1.0. Greedy requests (temperature 0) report unscaled logprobs: temperature 1.
"""
from __future__ import annotations

import json
from pathlib import Path

from polar_contracts.sampling_fields import GREEDY_EPS

TOLERANCE = 1e-6


class TemperatureMismatch(ValueError):
    """Shard rows sampled at a temperature other than the trainer's ``--temperature``."""


def generation_default(model) -> float:
    """The temperature the server applies to requests that set none: the model's
    generation_config.json (a loaded transformers model, or its directory), else 1.0."""
    gc = getattr(model, "generation_config", None)
    if gc is not None:
        t = getattr(gc, "temperature", None)
        return float(t) if t is not None else 1.0
    if isinstance(model, (str, Path)):
        f = Path(model) / "generation_config.json"
        if f.is_file():
            t = json.loads(f.read_text()).get("temperature")
            return float(t) if t is not None else 1.0
    return 1.0


def logprob_temperature(requested: float | None, served_default: float) -> float:
    """The temperature the server's reported logprobs were computed at."""
    t = served_default if requested is None else float(requested)
    return 1.0 if t < GREEDY_EPS else t


def check_rows(rows: list[dict], trainer_temperature: float, served_default: float, where: str) -> None:
    """Raise TemperatureMismatch naming the rows whose logprob temperature is not the trainer's.
    Rows without the column (shards older than it) are not checkable and pass."""
    bad = {}
    for r in rows:
        if "temperature" not in r:
            continue
        t = logprob_temperature(r["temperature"], served_default)
        if abs(t - trainer_temperature) > TOLERANCE:
            bad.setdefault((r["temperature"], t), []).append(r.get("episode_id"))
    if not bad:
        return
    parts = []
    for (req, t), eps in sorted(bad.items(), key=lambda kv: kv[0][1]):
        how = ("the requests set none: the served model's generation_config.json default"
               if req is None else f"requested {req:g}")
        parts.append(f"{t:g} ({how}; episodes {', '.join(sorted(map(str, set(eps))))})")
    temps = sorted({t for _, t in bad})
    fix = (f"Pass --temperature {temps[0]:g}" if len(temps) == 1 else
           "Train these groups separately: one run has one --temperature")
    raise TemperatureMismatch(
        f"{where}: the server sampled at temperature {'; '.join(parts)}, but the trainer computes "
        f"logprobs at temperature {trainer_temperature:g}: the importance ratios would measure the "
        f"temperature, not the policy. {fix} (or, if the server ran another model, set "
        f"--served_default_temperature to its generation_config.json temperature).")
