"""Truncated / masked importance sampling against the recorded behaviour logprobs.

The sequences were sampled by the inference server (behaviour policy mu, logprobs recorded by the
proxy); the trainer's policy at generation time is pi_old. TRL corrects exactly this mismatch for
its own vLLM (``vllm_importance_sampling_*``); this is the same computation, with the same mode
names, clip semantics and defaults, applied to the recorded logprobs:

    rho = exp(log pi_old - log mu)            per token (token_*) or summed over a sequence (sequence_*)
    *_truncate: rho <- clamp(rho, clip_min, clip_max)
    *_mask:     rho <- 0 where rho < clip_min or rho > clip_max

Positions outside the loss mask (prompt, tool output, padding) and NaN logprobs contribute a zero
log-difference, i.e. no correction, as in TRL.
"""
from __future__ import annotations

import math

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def is_ratio(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, mode: str,
             clip_min: float | None, clip_max: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (ratio, stats): ratio is (B, T) for token modes, (B, 1) for sequence modes.

    stats (over trainable tokens for token modes, over sequences with a trainable token for
    sequence modes): ratio mean/min/max after correction, raw (uncorrected) mean, the fraction
    clipped or masked, and mean/max |log pi_old - log mu| per token.
    """
    if mode not in MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; expected one of {MODES}")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"{mode} needs clip_min or clip_max")
    m = mask.to(old_logps.dtype)
    diff = torch.nan_to_num((old_logps - behaviour_logps) * m, nan=0.0)
    sequence = mode.startswith("sequence")
    log_rho = diff.sum(-1, keepdim=True) if sequence else diff
    raw = torch.exp(log_rho)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    outside = (raw < lo) | (raw > hi)
    if mode.endswith("truncate"):
        ratio = torch.clamp(raw, min=clip_min, max=clip_max)
    else:
        ratio = raw.masked_fill(outside, 0.0)
    keep = (m.sum(-1, keepdim=True) > 0) if sequence else m.bool()
    return ratio, _stats(ratio[keep], raw[keep], outside[keep], diff[m.bool()].abs())


def _stats(ratio: torch.Tensor, raw: torch.Tensor, outside: torch.Tensor, absdiff: torch.Tensor) -> dict[str, float]:
    if ratio.numel() == 0:
        return {}
    return {
        "mean": ratio.mean().item(),
        "min": ratio.min().item(),
        "max": ratio.max().item(),
        "raw_mean": raw.mean().item(),
        "clipped_frac": outside.float().mean().item(),
        "logp_diff_mean": absdiff.mean().item() if absdiff.numel() else 0.0,
        "logp_diff_max": absdiff.max().item() if absdiff.numel() else 0.0,
    }
