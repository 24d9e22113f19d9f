"""Truncated / masked importance sampling against the recorded behaviour logprobs.

The sequences were sampled by the inference server (behaviour policy mu, logprobs recorded by the
proxy); the trainer's policy at generation time is pi_old. TRL corrects exactly this mismatch for
its own vLLM (``vllm_importance_sampling_*``); this is the same computation, with the same mode
names, clip semantics and defaults, applied to the recorded logprobs:

    rho = exp(log pi_old - log mu)            per token (token_*) or summed over a sequence (sequence_*)
    *_truncate: rho <- clamp(rho, clip_min, clip_max)
    *_mask:     rho <- 0 where rho < clip_min or rho > clip_max

Positions outside the loss mask (prompt, tool output, padding) contribute a zero log-difference, as
in TRL. What differs from TRL, so that one bad number never decides a sequence and every statistic
is finite:

- a trainable token whose pi_old or mu is not finite (-inf, NaN) is masked, not corrected: it gets no
  log-difference, the caller removes it from the loss (``nonfinite``, returned) and it is counted;
- ``exempt`` rows (a context the server never saw: realigned rows, grpo_trainer.py) get ratio 1 (no
  correction) and are left out of the ratio statistics;
- the statistics count what was clipped (outside the band) and what was masked (ratio set to 0, plus
  the non-finite tokens), and the log-difference statistics run over finite values only.
"""
from __future__ import annotations

import math

import torch

from trainer.config_choices import IS_MODES

MODES = IS_MODES  # the public name, kept


def is_ratio(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, mode: str,
             clip_min: float | None, clip_max: float | None, exempt: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (ratio, stats): ratio is (B, T) for token modes, (B, 1) for sequence modes.

    stats (over the trainable tokens of non-exempt rows for token modes, over non-exempt sequences with a
    trainable token for sequence modes): ratio mean/min/max after correction, raw (uncorrected) mean, the
    fraction clipped (outside [clip_min, clip_max]) and masked (ratio 0 by a *_mask mode, or, token
    modes, a non-finite token), mean/max |log pi_old - log mu| over finite tokens, and the count and
    fraction of trainable tokens that were not finite (``nonfinite_tokens``, ``nonfinite_frac``).
    ``is_ratio_masks`` returns the non-finite positions for the caller to drop from the loss.
    """
    ratio, stats, _ = is_ratio_masks(old_logps, behaviour_logps, mask, mode, clip_min, clip_max, exempt)
    return ratio, stats


def is_ratio_masks(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                   clip_min: float | None, clip_max: float | None, exempt: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """``is_ratio`` plus the (B, T) bool mask of trainable tokens that were not finite."""
    if mode not in MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; expected one of {MODES}")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"{mode} needs clip_min or clip_max")
    train = mask.bool()
    raw_diff = old_logps.float() - behaviour_logps.float()
    nonfinite = train & ~torch.isfinite(raw_diff)
    ok = train & ~nonfinite
    rows = torch.ones(mask.size(0), dtype=torch.bool, device=mask.device) if exempt is None else ~exempt.bool()
    diff = torch.where(ok & rows.unsqueeze(1), raw_diff, torch.zeros_like(raw_diff))
    sequence = mode.startswith("sequence")
    log_rho = diff.sum(-1, keepdim=True) if sequence else diff
    raw = torch.exp(log_rho)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    outside = (raw < lo) | (raw > hi)
    if mode.endswith("truncate"):
        ratio = torch.clamp(raw, min=clip_min, max=clip_max)
        zeroed = torch.zeros_like(outside)
    else:
        ratio = raw.masked_fill(outside, 0.0)
        zeroed = outside
    if sequence:
        keep = (train.sum(-1, keepdim=True) > 0) & rows.unsqueeze(1)
        masked = zeroed[keep]
    else:
        ratio = ratio.masked_fill(nonfinite, 0.0)
        keep = train & rows.unsqueeze(1)
        masked = (zeroed | nonfinite)[keep]
    finite_diff = raw_diff[ok & rows.unsqueeze(1)].abs()
    stats = _stats(ratio[keep], raw[keep], outside[keep], masked, finite_diff)
    n_train = int(train.sum())
    stats["nonfinite_tokens"] = float(nonfinite.sum())
    stats["nonfinite_frac"] = float(nonfinite.sum()) / n_train if n_train else 0.0
    return ratio, stats, nonfinite


def _stats(ratio: torch.Tensor, raw: torch.Tensor, outside: torch.Tensor, masked: torch.Tensor,
           absdiff: torch.Tensor) -> dict[str, float]:
    if ratio.numel() == 0:
        return {}
    return {
        "mean": ratio.mean().item(),
        "min": ratio.min().item(),
        "max": ratio.max().item(),
        "raw_mean": raw.mean().item(),
        "clipped_frac": outside.float().mean().item(),
        "masked_frac": masked.float().mean().item(),
        "logp_diff_mean": absdiff.mean().item() if absdiff.numel() else 0.0,
        "logp_diff_max": absdiff.max().item() if absdiff.numel() else 0.0,
    }
