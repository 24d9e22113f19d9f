"""Truncated / masked importance sampling against the recorded behaviour logprobs.

The sequences were sampled by the inference server (behaviour policy mu, logprobs recorded by the
proxy); the trainer's policy at generation time is pi_old. TRL corrects exactly this mismatch for
its own vLLM (``vllm_importance_sampling_*``); this is the same computation, with the same mode
names, clip semantics and defaults, applied to the recorded logprobs:

    rho = exp(log pi_old - log mu)            per token (token_*) or summed over a sequence (sequence_*)
    *_truncate: rho <- clamp(rho, clip_min, clip_max)
    *_mask:     rho <- 0 where rho < clip_min or rho > clip_max

Positions outside the loss mask (prompt, tool output, padding) contribute a zero log-difference, as
in TRL. What differs from TRL, so that one bad number never decides a sequence silently and every
statistic is finite:

- a trainable token whose pi_old or mu is not finite (-inf, NaN) is not corrected: in token modes the
  token alone gets weight 0; in sequence modes its whole sequence does (the sum over the other tokens
  would not be the sequence's ratio; TRL's sum is -inf there, slime's veto rejects the sequence);
- every trainable token that gets weight 0 (that, or a *_mask mode's band) is returned by reason
  (``is_ratio_lost``): the trainer takes it out of the loss and counts it in the exclusion ledger
  (trainer/row_exclusions.py), so ``polar/excluded_share`` and the ``max_excluded_share`` stop see it;
- ``exempt`` rows (a context the server never saw: realigned rows with ``realign_is=exempt``,
  grpo_trainer.py) get ratio 1 (no correction) and are left out of the ratio statistics;
- the statistics count what was clipped (outside the band) and what was masked (ratio set to 0), and
  the log-difference statistics run over finite values only.

Which mode fits agent rows (thousands of tokens): docs/training.md, measured in
docs/benchmarks/trainer.md (bench/bench_is_agent_rows.py). A sequence ratio is a product over every
token of the row, so a per-token mismatch of realistic size (bf16 vs fp32, other kernels) moves it
far from 1 on long rows, and a sequence_mask band then drops whole rows; a per-token ratio does not
grow with the row.
"""
from __future__ import annotations

import math

import torch

from trainer.config_choices import IS_MODES

MODES = IS_MODES  # the public name, kept
LOST_REASONS = ("nonfinite_logprob", "is_ratio_high", "is_ratio_low")  # counted in row_exclusions.py
VANISHING = 1e-3  # a weight below this trains (almost) nothing: ``vanishing_weight_share``


def is_ratio(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, mode: str,
             clip_min: float | None, clip_max: float | None, exempt: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Return (ratio, stats): ratio is (B, T) for token modes, (B, 1) for sequence modes.

    stats (over the trainable tokens of non-exempt rows for token modes, over non-exempt sequences with a
    trainable token for sequence modes): ratio mean/min/max after correction, raw (uncorrected) mean, the
    fraction clipped (outside [clip_min, clip_max]) and masked (ratio 0: by a *_mask mode, a non-finite
    token in token modes, a sequence holding one in sequence modes), mean/max |log pi_old - log mu| over
    finite tokens, the mean signed log ratio per finite token (``logp_diff_signed_mean``), the count and
    fraction of trainable tokens that were not finite (``nonfinite_tokens``, ``nonfinite_frac``), the
    share of trainable tokens that get no weight (``lost_token_share``, every reason) and the share whose
    weight is above 0 but below VANISHING (``vanishing_weight_share``, not counted as lost).
    ``is_ratio_lost`` returns the zeroed tokens by reason for the caller to drop from the loss and count.
    """
    ratio, stats, _ = is_ratio_lost(old_logps, behaviour_logps, mask, mode, clip_min, clip_max, exempt)
    return ratio, stats


def is_ratio_masks(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                   clip_min: float | None, clip_max: float | None, exempt: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    """``is_ratio`` plus the (B, T) bool mask of trainable tokens that were not finite (the tokens only:
    ``is_ratio_lost`` says which tokens a whole failed sequence takes with it)."""
    ratio, stats, _ = is_ratio_lost(old_logps, behaviour_logps, mask, mode, clip_min, clip_max, exempt)
    train = mask.bool()
    nonfinite = train & ~torch.isfinite(old_logps.float() - behaviour_logps.float())
    return ratio, stats, nonfinite


def is_ratio_lost(old_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                  clip_min: float | None, clip_max: float | None, exempt: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, dict[str, float], dict[str, torch.Tensor]]:
    """``is_ratio`` plus the trainable tokens that get weight 0, as {reason: (B, T) bool} over
    ``LOST_REASONS`` (a token in one reason only; reasons with no token are left out):

    - ``nonfinite_logprob``: token modes, the token whose pi_old or mu is not finite; sequence modes, every
      trainable token of a (non-exempt) sequence holding one. A sequence ratio that leaves out a token
      which could not be scored is not the sequence's ratio: TRL's sum makes it 0 (-inf), slime's veto
      rejects it, so it fails whole here too, and is counted;
    - ``is_ratio_high`` / ``is_ratio_low``: a *_mask mode zeroed the token (token modes) or its sequence
      (sequence modes) for a ratio above clip_max / below clip_min.
    """
    if mode not in MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; expected one of {MODES}")
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        raise ValueError(f"{mode} needs clip_min or clip_max")
    train = mask.bool()
    raw_diff = old_logps.float() - behaviour_logps.float()
    nonfinite = train & ~torch.isfinite(raw_diff)
    ok = train & ~nonfinite
    rows = torch.ones(mask.size(0), dtype=torch.bool, device=mask.device) if exempt is None else ~exempt.bool()
    rows_ = rows.unsqueeze(1)
    diff = torch.where(ok & rows_, raw_diff, torch.zeros_like(raw_diff))
    sequence = mode.startswith("sequence")
    log_rho = diff.sum(-1, keepdim=True) if sequence else diff
    raw = torch.exp(log_rho)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    high, low = raw > hi, raw < lo
    outside = high | low
    if mode.endswith("truncate"):
        ratio = torch.clamp(raw, min=clip_min, max=clip_max)
        zeroed = torch.zeros_like(outside)
    else:
        ratio = raw.masked_fill(outside, 0.0)
        zeroed = outside
    if sequence:
        failed = nonfinite.any(-1, keepdim=True) & rows_  # exempt rows: the bad token alone leaves (below)
        ratio = ratio.masked_fill(failed, 0.0)
        keep = (train.sum(-1, keepdim=True) > 0) & rows_
        masked = (zeroed | failed)[keep]
        lost_nonfinite = (failed & train) | nonfinite
        lost_high, lost_low = (high & ~failed & zeroed) & train, (low & ~failed & zeroed) & train
    else:
        ratio = ratio.masked_fill(nonfinite, 0.0)
        keep = train & rows_
        masked = (zeroed | nonfinite)[keep]
        lost_nonfinite = nonfinite
        lost_high, lost_low = high & zeroed & ok & rows_, low & zeroed & ok & rows_
    finite_diff = raw_diff[ok & rows_]
    stats = _stats(ratio[keep], raw[keep], outside[keep], masked, finite_diff)
    n_train = int(train.sum())
    lost = {"nonfinite_logprob": lost_nonfinite, "is_ratio_high": lost_high, "is_ratio_low": lost_low}
    lost = {k: v for k, v in lost.items() if bool(v.any())}
    stats["nonfinite_tokens"] = float(nonfinite.sum())
    stats["nonfinite_frac"] = float(nonfinite.sum()) / n_train if n_train else 0.0
    stats["lost_token_share"] = float(sum(int(v.sum()) for v in lost.values())) / n_train if n_train else 0.0
    # Weights that are not 0 yet train (almost) nothing: a sequence ratio far below 1 on a long row
    # (no clip_min) drops the row as surely as a mask, uncounted; this shows it.
    w = ratio.expand_as(raw_diff) if ratio.size(1) == 1 and raw_diff.size(1) != 1 else ratio
    tiny = train & rows_ & (w > 0) & (w < VANISHING)
    stats["vanishing_weight_share"] = float(tiny.sum()) / n_train if n_train else 0.0
    return ratio, stats, lost


def _stats(ratio: torch.Tensor, raw: torch.Tensor, outside: torch.Tensor, masked: torch.Tensor,
           diff: torch.Tensor) -> dict[str, float]:
    if ratio.numel() == 0:
        return {}
    absdiff = diff.abs()
    return {
        "mean": ratio.mean().item(),
        "min": ratio.min().item(),
        "max": ratio.max().item(),
        "raw_mean": raw.mean().item(),
        "clipped_frac": outside.float().mean().item(),
        "masked_frac": masked.float().mean().item(),
        "logp_diff_mean": absdiff.mean().item() if absdiff.numel() else 0.0,
        "logp_diff_max": absdiff.max().item() if absdiff.numel() else 0.0,
        "logp_diff_signed_mean": diff.mean().item() if diff.numel() else 0.0,
    }
