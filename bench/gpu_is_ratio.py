"""The importance ratio with a bf16 server on an accelerator and the fp32 CPU trainer (docs/training.md,
"Importance-sampling correction"): one
short, self-contained run (torch + transformers, no vLLM) that prints one JSON line.

    PYTHONPATH=. python bench/gpu_is_ratio.py [--device cuda] [--dtype bf16] [--seqs 64] [--tokens 64]

(with $OUT set it also writes $OUT/gpu_is_ratio.json)

1. Builds the tiny random Qwen3 (polar_serve/tiny.py: the real vocabulary, 151,936 ids) into a temporary
   directory.
2. The "server": that model in ``--dtype`` on ``--device``, batched decoding with a KV cache, and its own
   sampler in vLLM 0.32's order (vllm/v1/sample/sampler.py): logits cast to float32, / temperature, min_p,
   top_k (ties kept), top_p (ascending cumulative mass <= 1 - p dropped, the largest kept), processed
   logprobs = log_softmax of the masked logits, the token drawn as argmax(probs / q), q ~ Exp(1) (vLLM's
   ``random_sample``). Qwen3's defaults: T=0.6, top_k=20, top_p=0.95.
3. The "trainer": the same weights in float32 on the CPU, pi_old of every sampled token under the same
   transform with the repository's trainer code (trainer/behaviour_logprobs.py ``sampled_token_logprobs``,
   trainer/is_correction.py ``is_ratio_masks``, sequence_mask, clip_max 3), by the OLD rule (the trainer's
   recomputed kept set only) and the NEW one (the sampled token re-added when within BOUNDARY_TOL of the cut
   that dropped it).

Output: the device, dtype, timings and, per rule, the share of tokens with pi_old -inf, the share that
needed the sampled token added, the sequence ratio mean / min, the share of sequences zeroed (< 1e-6)
or outside [1/3, 3], the mean (signed) log ratio per token and, for the trainer's rule, the share of
trainable tokens each IS mode gives weight 0 (``lost_token_share``: what the trainer counts in the
excluded share); ``after_server_dtype_cut`` is the default rule with the cuts made on the trainer's logits
rounded to ``--dtype`` (polar-train's ``--server_logits_dtype``). Long rows: ``--tokens 2048 --seqs 16``
(the check of the default on long rows, on a GPU).
Runs in well under 3 minutes on one GPU (64 x 64 tokens); on a CPU (``--device cpu
--dtype bf16``) in about a minute (tests/trainer/test_gpu_script.py runs it so).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def vllm_processed(logits, temperature: float, top_k: int, top_p: float, min_p: float):
    """The processed logits (kept tokens finite, the rest -inf) in vLLM 0.32's sampler order, written here
    independently of trainer/behaviour_logprobs.py."""
    import torch

    z = logits.float() / temperature
    neg = torch.tensor(-float("inf"), device=z.device)
    if min_p > 0:
        p = z.softmax(-1)
        z = torch.where(p < p.amax(-1, keepdim=True) * min_p, neg, z)
    if top_k > 0:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = torch.where(z < kth, neg, z)
    if top_p < 1:
        vals, idx = z.sort(-1)  # ascending
        drop = vals.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        z = z.scatter(-1, idx, torch.where(drop, neg, vals))
    return z


def vllm_sample(logits, temperature: float, top_k: int, top_p: float, min_p: float, gen, processed=None):
    """(tokens (B,), processed logprobs of them (B,)): vLLM 0.32's sampler (``random_sample``: argmax of
    probs / q, q ~ Exp(1)). ``processed``: the output of ``vllm_processed`` when the caller has it."""
    import torch

    z = vllm_processed(logits, temperature, top_k, top_p, min_p) if processed is None else processed
    logp = z.log_softmax(-1)
    q = torch.empty_like(logp).exponential_(1.0, generator=gen)
    tok = (logp.exp() / q).argmax(-1)
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from polar_serve.tiny import make_tiny
    from trainer.behaviour_logprobs import Transform, sampled_token_logprobs
    from trainer.is_correction import MODES, is_ratio_lost, is_ratio_masks

    if a.threads:
        torch.set_num_threads(a.threads)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t = Transform(0.6, 20, 0.95, 0.0)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-is-") as tmp:
        model_dir = make_tiny(Path(tmp) / "tiny", seed=a.seed)
        server = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, DTYPES[a.dtype]))
        server = server.to(device).eval()
        trainer = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(0, 150_000, (a.seqs, a.prompt_len), generator=g)
    gen = torch.Generator(device=device).manual_seed(a.seed)
    t1 = time.perf_counter()
    with torch.no_grad():  # the server: batched decoding with a KV cache
        ids = prompts.to(device)
        out = server(input_ids=ids, use_cache=True)
        past, toks, behaviour = out.past_key_values, [], []
        for _ in range(a.tokens):
            tok, lp = vllm_sample(out.logits[:, -1], t.temperature, t.top_k, t.top_p, t.min_p, gen)
            toks.append(tok)
            behaviour.append(lp)
            out = server(input_ids=tok[:, None], past_key_values=past, use_cache=True)
            past = out.past_key_values
        completion = torch.stack(toks, 1).cpu()
        behaviour = torch.stack(behaviour, 1).float().cpu()
    t2 = time.perf_counter()
    full = torch.cat([prompts, completion], 1)
    # (keep_sampled, cut_dtype): the old rule, the default, and the cuts at the server's precision
    # (--server_logits_dtype; trainer/behaviour_logprobs.py ``cut_dtype``)
    cut = getattr(torch, DTYPES[a.dtype]) if a.dtype != "fp32" else None
    rules = {"before": (False, None), "after": (True, None), "after_server_dtype_cut": (True, cut)}
    old = {r: torch.zeros_like(behaviour) for r in rules}
    added = {r: torch.zeros_like(completion, dtype=torch.bool) for r in rules}
    with torch.no_grad():  # the trainer: fp32 on the CPU, the logits that predict each completion token
        for i in range(a.seqs):
            logits = trainer(input_ids=full[i:i + 1]).logits[0, a.prompt_len - 1:-1].float()
            for r, (keep, cut_dtype) in rules.items():
                old[r][i], added[r][i] = sampled_token_logprobs(logits, completion[i], t, keep_sampled=keep,
                                                                cut_dtype=cut_dtype)
    mask = torch.ones_like(completion)
    res = {"device": device, "device_name": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
           "server_dtype": a.dtype, "trainer": "float32 cpu", "seqs": a.seqs, "tokens": a.tokens,
           "transform": str(t), "torch": torch.__version__}
    for rule, (keep, _) in rules.items():
        old_r = old[rule]
        if keep:
            _, _, bad = is_ratio_masks(old_r, behaviour, mask, "sequence_mask", None, 3.0)
            rho = torch.exp((old_r - behaviour).masked_fill(bad, 0.0).sum(-1).double())
        else:  # what is_correction.py did before: nan_to_num(-inf) summed, the sequence's ratio 0
            rho = torch.exp(torch.nan_to_num(old_r - behaviour).sum(-1).double())
        res[rule] = {"masked_token_share": float(torch.isneginf(old_r).float().mean()),
                     "kept_set_fix_share": float(added[rule].float().mean()),
                     "seq_ratio_mean": float(rho.mean()), "seq_ratio_min": float(rho.min()),
                     "seq_zeroed_share": float((rho < 1e-6).double().mean()),
                     "seq_outside_1/3_3": float(((rho < 1 / 3) | (rho > 3)).double().mean()),
                     "abs_log_ratio_per_token": float((old_r - behaviour)[torch.isfinite(old_r)].abs().mean()),
                     "mean_log_ratio_per_token": float((old_r - behaviour)[torch.isfinite(old_r)].mean())}
        if keep:  # per IS mode (clip_max 3, the trainer's code): the share of trainable tokens given weight 0
            res[rule]["lost_token_share"] = {
                mode: is_ratio_lost(old_r, behaviour, mask, mode, None, 3.0)[1]["lost_token_share"] for mode in MODES}
    res["seconds"] = {"build_and_load": t1 - t0, "sample": t2 - t1, "trainer": time.perf_counter() - t2}
    line = json.dumps(res)
    print(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_is_ratio.json").write_text(line + "\n")
    return res


if __name__ == "__main__":
    main()
