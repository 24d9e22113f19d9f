"""The distribution a server's reported logprobs reflect, per shard row, and the policy's log-prob of
each sampled token under it (the old-policy side of the importance ratio).

A shard row records the sampling parameters the server applied (``temperature``, ``top_k``,
``top_p``, ``min_p``; normalised: top_k off = -1, top_p off = 1.0, min_p off = 0.0, greedy =
temperature 0.0) and what its logprobs are (``logprobs_mode``):

- ``processed`` (vLLM ``--logprobs-mode processed_logprobs``, polar-serve's vllm dialect): the
  log-softmax of the logits after everything the sampler did before drawing the token. vLLM 0.32's
  order (vllm/v1/sample/sampler.py, ``Sampler.sample``):
    1. temperature: ``logits / T`` (sampler.py:279, ``apply_temperature`` :230-239);
    2. the argmax-invariant logits processors, by default only min_p (sampler.py:285-286;
       v1/sample/logits_processor/builtin.py ``MinPLogitsProcessor.apply``: drop tokens whose
       probability under softmax(logits/T) is below min_p * the largest one);
    3. top-k then top-p (sampler.py:289 -> ops/topk_topp_sampler.py ``forward_cpu`` :315-333 on
       the CPU build, ``forward_native`` :263-279 elsewhere; both call ``apply_top_k_top_p`` :460,
       which without Triton, as on CPU, is ``apply_top_k_top_p_pytorch`` :473-514): top-k keeps
       the tokens whose logit is >= the k-th largest (ties kept; ``apply_top_k_only`` :517-536 is
       the same rule without a sort); top-p sorts ascending, takes the softmax of the top-k-masked
       logits, and drops the tokens whose ascending cumulative probability is <= 1 - p (the largest
       token always kept);
    4. the processed logprobs are ``log_softmax`` of those masked logits (topk_topp_sampler.py:
       332-333), i.e. renormalised over the kept tokens, and the token is sampled from them.
  Greedy requests (T < 1e-5; vLLM then forces top_k/top_p/min_p off, sampling_params.py:612-616):
  the log-softmax of the unscaled logits (sampler.py:264-273, or a mixed batch's T -> 1.0 at :238).
- ``scaled`` (SGLang 0.5.23's default, sglang/srt/layers/sampler.py :275 divides by the temperature
  and the logprobs are taken before top-k/top-p): log-softmax of ``logits / T``, no truncation;
  greedy: unscaled (:220-221). Both sides of the ratio are then the untruncated tempered softmax: exact
  on-policy (ratio 1); off-policy it omits the ratio of the kept masses Z_old/Z_mu, which the server's
  per-token scaled logprob does not carry (processed logprobs do).
- ``raw`` (stock vLLM's default) or unknown: the ratio cannot be formed; ``row_transform`` raises
  LogprobsModeError with the fix, which the rollout turns into a counted exclusion (row_exclusions.py:
  training stops only past max_excluded_share). One
  exception, because there raw IS processed: a raw row whose recorded sampling is the identity
  (temperature 1 or greedy, top_k -1, top_p 1, min_p 0, nothing in ``sampling_unsupported``): no
  temperature, mask or processor stands between the raw logits and the sampled distribution
  (sampler.py:279-294 with T=1, k=V, p=1; the demo's forced-reply vLLM runs this way).

Penalties, logit bias, bad words, allowed token ids, structured output and the like change the
distribution in ways the row does not record; the proxy says so in ``sampling_unsupported`` and such
rows are excluded (``row_transform`` returns the reason).

Memory: the vocabulary is 151,936 for Qwen3; ``token_logprobs`` works on ``chunk`` positions at a
time (a few (chunk, V) float32 buffers), sorting only the tokens top-k kept when top-k is on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from polar_contracts.sampling_fields import GREEDY_EPS
from trainer.row_temperature import logprob_temperature

LOGPROBS_MODES = ("processed", "scaled")
FIX = ("start the server with processed logprobs: `vllm serve ... --logprobs-mode processed_logprobs` "
       "(polar-serve: the same flag, `polar-serve ... --logprobs-mode processed_logprobs`)")
# The sampled token counts as kept when it lies within the numerics of the cut each truncation really
# makes (``cut_slack``). LOGIT_TOL is how far one raw logit of the trainer may sit from the server's:
# measured (bench/bench_is_agent_rows.py, docs/benchmarks/trainer.md) as 4 sigma of the logit noise of
# other kernels and batch shapes (0.03: 0.12) plus half a bf16 step at |logit| < 32 (0.0625), rounded
# up. Every cut compares two quantities that each move by at most LOGIT_TOL: min_p the token's logit
# with the largest one, top_k with the k-th largest one (an order statistic moves no more than the
# values), top_p the log of the mass above the token, whose numerator and denominator (sums of
# exponentials) each move by at most LOGIT_TOL in log. So a token the server kept is never further than
# BOUNDARY_TOL = 2 * LOGIT_TOL (raw logits; / temperature in the scaled logits the cuts are made on)
# outside the trainer's cut; a token further outside (a row whose tokens do not belong to its logprobs,
# a wrong sampling record) stays at -inf and is masked and counted.
LOGIT_TOL = 0.2
BOUNDARY_TOL = 2 * LOGIT_TOL
CHUNK = 128  # positions per (chunk, vocab) buffer: 128 x 151936 x 4 B = 78 MB


class LogprobsModeError(ValueError):
    """A row whose recorded logprobs cannot serve as the behaviour policy of an importance ratio."""


@dataclass(frozen=True)
class Transform:
    """The distribution the server's logprobs for one row reflect: softmax(logits / temperature),
    then min_p, top_k, top_p masks (in vLLM's order), renormalised. ``temperature`` is the logprob
    temperature (greedy rows: 1.0)."""
    temperature: float
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"logprob temperature must be > 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def __str__(self) -> str:
        return f"T={self.temperature:g} top_k={self.top_k} top_p={self.top_p:g} min_p={self.min_p:g}"


def row_transform(row: dict, served_default_temperature: float, where: str = "row") -> tuple[Transform | None, str]:
    """(transform, "") for a row the trainer can reproduce, (None, reason) for one it must exclude.
    Raises LogprobsModeError for ``raw`` or unknown (null/absent) logprob modes."""
    mode = row.get("logprobs_mode")
    if mode == "raw" and _identity(row, served_default_temperature):
        return Transform(1.0), ""
    if mode not in LOGPROBS_MODES:
        what = ("raw logprobs (log-softmax of the unscaled, untruncated logits: stock vLLM's default)"
                if mode == "raw" else "logprobs of an unknown mode (logprobs_mode is null: the proxy could not "
                "determine it, or the shard predates the column)" if mode is None else f"logprobs_mode {mode!r}")
        raise LogprobsModeError(
            f"{where} (episode {row.get('episode_id')}): the server reported {what}; importance sampling needs the "
            f"logprobs of the distribution the token was sampled from. Fix: {FIX}, or train without the correction "
            f"(--vllm_importance_sampling_correction false).")
    unsupported = row.get("sampling_unsupported")
    if unsupported:
        return None, f"sampling the trainer cannot reproduce: {unsupported}"
    t_req = row.get("temperature")
    t = logprob_temperature(t_req, served_default_temperature)
    greedy = (served_default_temperature if t_req is None else float(t_req)) < GREEDY_EPS
    if mode == "scaled" or greedy:
        return Transform(t), ""
    missing = [c for c in ("top_k", "top_p", "min_p") if row.get(c) is None]
    if missing:
        source = row.get("sampling_source")
        why = f": {source}" if source else " (the proxy could not tell what the server applied)"
        return None, f"unknown {'/'.join(missing)}: null{why}"
    k = int(row["top_k"])
    return Transform(t, k if k > 0 else -1, float(row["top_p"]), float(row["min_p"])), ""


def _identity(row: dict, served_default_temperature: float) -> bool:
    """The row's recorded sampling is the identity transform (so raw logprobs are the processed ones)."""
    t = row.get("temperature")
    return (t is not None and (float(t) == 1.0 or float(t) < GREEDY_EPS) and not row.get("sampling_unsupported")
            and (float(t) < GREEDY_EPS or (row.get("top_k") is not None and int(row["top_k"]) <= 0
                                             and row.get("top_p") == 1.0 and row.get("min_p") == 0.0)))


def mask_logits_(z: torch.Tensor, t: Transform) -> torch.Tensor:
    """Apply min_p, top_k, top_p (vLLM's order and tie rules) in place to temperature-scaled logits
    z (N, V); masked tokens become -inf."""
    neg = -math.inf
    v = z.size(-1)
    if t.min_p > 0.0:
        probs = z.softmax(-1)
        z.masked_fill_(probs < probs.amax(-1, keepdim=True) * t.min_p, neg)
        del probs
    top_k = 0 < t.top_k < v
    if top_k:
        kth = z.topk(t.top_k, dim=-1).values[:, -1:]
        z.masked_fill_(z < kth, neg)
    if t.top_p < 1.0:
        if top_k:
            # Only the kept tokens can survive top-p; sort those (ties at the k-th value included).
            n = int((z > neg).sum(-1).max())
            vals, idx = z.topk(n, dim=-1)  # descending
            vals, idx = vals.flip(-1), idx.flip(-1)  # ascending, as vLLM sorts
        else:
            vals, idx = z.sort(-1)
        cum = vals.softmax(-1).cumsum(-1)
        drop = cum <= 1.0 - t.top_p
        drop[:, -1] = False  # at least one
        z.scatter_(-1, idx, vals.masked_fill_(drop, neg))
    return z


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, t: Transform, chunk: int = CHUNK,
                   keep_sampled: bool = True, cut_dtype: torch.dtype | None = None) -> torch.Tensor:
    """log p(token) under ``t`` for each position: logits (N, V) unscaled, tokens (N,) -> (N,) float32
    (``sampled_token_logprobs`` without the count)."""
    return sampled_token_logprobs(logits, tokens, t, chunk, keep_sampled, cut_dtype)[0]


def cut_slack(z: torch.Tensor, tok: torch.Tensor, t: Transform) -> torch.Tensor:
    """How far (temperature-scaled logits; log-mass for top_p) each sampled token lies outside the cut
    of each truncation, the largest of them (<= 0: inside every cut), (N, 1). z: (N, V) scaled logits,
    unmasked; tok: (N, 1) the sampled token ids. The cuts, in vLLM's order (min_p, top_k, top_p):

    - min_p: kept iff z_tok - z_max >= log(min_p);
    - top_k: kept iff z_tok >= the k-th largest logit left by min_p;
    - top_p: kept iff the mass strictly above the token, among the tokens min_p and top_k left plus the
      token itself, is < top_p (vLLM drops a token whose ascending cumulative mass is <= 1 - top_p).
    """
    neg = -math.inf
    before = z.gather(-1, tok)
    slack = torch.full_like(before, neg)
    w = z
    if t.min_p > 0.0:
        zmax = z.amax(-1, keepdim=True)
        slack = torch.maximum(slack, math.log(t.min_p) - (before - zmax))
        w = z.masked_fill(z - zmax < math.log(t.min_p), neg)
    if 0 < t.top_k < z.size(-1):
        kth = w.topk(t.top_k, dim=-1).values[:, -1:]
        slack = torch.maximum(slack, kth - before)
        w = w.masked_fill(w < kth, neg)
    if t.top_p < 1.0:
        total = w.scatter(-1, tok, before).logsumexp(-1, keepdim=True)  # the kept tokens and the sampled one
        above = w.masked_fill(w <= before, neg).logsumexp(-1, keepdim=True)
        slack = torch.maximum(slack, above - total - math.log(t.top_p))
    return slack


def sampled_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, t: Transform, chunk: int = CHUNK,
                           keep_sampled: bool = True, cut_dtype: torch.dtype | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(token) under ``t`` per position, float32 (N,); added (N,) bool).

    The sampled token counts as kept (``keep_sampled``) when the trainer's recomputed set drops it but it
    lies within BOUNDARY_TOL / temperature of the cut that dropped it (``cut_slack``: the min_p ratio, the
    top_k rank, the top_p mass, each measured where that truncation cuts): the server drew it, so it was
    in the server's kept set, and the trainer's logits are never the server's bit for bit (bf16 vs fp32,
    other kernels and batch shapes), so a token at a cut can fall just outside the trainer's set; without
    this its pi_old would be -inf (its token, or in a sequence mode its sequence, lost). A token further
    outside stays -inf: masked and counted. With it the distribution is renormalised over the trainer's
    kept set plus the sampled token; the error against the server's normaliser is the mass of the tokens
    at the cuts on which the two sets disagree (only the server's own mask removes it: docs/training.md).
    ``added`` marks the positions where the token had to be added (logged as a share: a large share means
    the recorded sampling parameters are not the applied ones). ``keep_sampled=False`` is the old rule
    (-inf outside the set), kept for the benchmarks.

    ``cut_dtype``: make the cuts on the logits rounded to the server's precision (e.g. torch.bfloat16), the
    probabilities still on the trainer's own. A bf16 server makes its cuts on bf16 logits: a min_p cut
    compares differences that lie on the bf16 grid, so it sits, on average, inside
    the exact threshold, and top_k keeps the ties the grid makes; an fp32 trainer's set then differs one
    way on average, not at random, and the mean log ratio moves by up to a few 1e-3 per token
    (bench/bench_is_agent_rows.py, docs/benchmarks/trainer.md). Rounding the trainer's logits the same
    way removes that; None (the default) cuts on the logits as they are (right when both sides share a
    precision: rounding a bf16 trainer's logits to bf16 changes nothing)."""
    if logits.dim() != 2 or tokens.shape != logits.shape[:1]:
        raise ValueError(f"logits (N, V) and tokens (N,) expected, got {tuple(logits.shape)} and {tuple(tokens.shape)}")
    out = torch.empty(logits.size(0), dtype=torch.float32, device=logits.device)
    added = torch.zeros(logits.size(0), dtype=torch.bool, device=logits.device)
    tol = BOUNDARY_TOL / t.temperature
    for s in range(0, logits.size(0), chunk):
        z = logits[s:s + chunk].float() / t.temperature  # a new buffer: the caller's logits stay untouched
        tok = tokens[s:s + chunk].long().unsqueeze(-1)
        if t.truncates:
            before = z.gather(-1, tok)
            zc = z if cut_dtype is None else logits[s:s + chunk].to(cut_dtype).float() / t.temperature
            slack = cut_slack(zc, tok, t) if keep_sampled else None
            if cut_dtype is None:
                mask_logits_(z, t)
            else:
                z.masked_fill_(torch.isneginf(mask_logits_(zc, t)), -math.inf)
            if keep_sampled:
                lost = torch.isneginf(z.gather(-1, tok)) & torch.isfinite(before) & (slack <= tol)
                z.scatter_(-1, tok, torch.where(lost, before, z.gather(-1, tok)))
                added[s:s + chunk] = lost.squeeze(-1)
        out[s:s + chunk] = (z.gather(-1, tok) - z.logsumexp(-1, keepdim=True)).squeeze(-1)
    return out, added
