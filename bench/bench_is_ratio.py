"""Importance-sampling ratios on the real vLLM with Qwen3's default sampling: full-softmax pi_old (what
TRL computes) vs the truncation-aware pi_old (trainer/behaviour_logprobs.py), side by side on the same rows.

    .venv/bin/python bench/bench_is_ratio.py [--vllm-url URL] [--groups 8] [--group-size 4] [--max-tokens 16]

Without --vllm-url it starts the real vLLM 0.32 (local_stack.VLLM_FLAGS: --logprobs-mode processed_logprobs)
on the tiny Qwen3 and stops it after. Episodes: one chat call each, through the capture proxy, with no
sampling field (the server applies the model's generation_config.json: T=0.6, top_k=20, top_p=0.95; the
proxy records them, polar_generation_config); polar-recon builds the shards; PolarGRPOTrainer takes one
step at learning rate 0 (on-policy: pi_old is the policy that sampled) with TRL's default correction
(sequence_mask, clip_max 3). Reported per pi_old: the sequence ratio's mean/min/max, the share of rows
masked at those defaults (ratio > 3), the share of rows whose ratio falls outside [1/3, 3] (what a
two-sided band would mask; a ratio near 0 zeroes the row's advantage just the same), the mean |log
ratio| per token, and the seconds the trainer spent forming pi_old for the batch.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("POLAR_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))  # the checkout's, as make


def post(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read() or b"null")


def collect(upstream: str, model_dir: Path, work: Path, groups: int, g: int, max_tokens: int) -> Path:
    from harness_recipes.node.local_stack import capture_proxy
    from polar_recon.build import Options, build

    with capture_proxy(upstream, work / "logs", control_secret=None, sets={"polar_generation_config": str(model_dir)}) as px:
        for k in range(groups):
            for e in range(g):
                ep = f"g{k}-e{e}"
                post(px.url, "/v1/chat/completions", {
                    "model": "polar-model", "max_tokens": max_tokens, "seed": 1000 * k + e,
                    "messages": [{"role": "user", "content": f"Task {k}: write a haiku about the sea."}]},
                    {"x-polar-episode": ep})
                post(px.url, f"/polar/{ep}/end", {"reward": float(e % 2), "metadata": {"group_id": f"g{k}"}})
    rep = build(work / "logs", work / "shards", Options(group_size=g))
    if len(rep.built) != groups * g or rep.errors:
        raise RuntimeError(f"recon: {rep}")
    return work / "shards"


def summarise(old, behaviour, mask, seconds: float) -> dict:
    from trainer.is_correction import is_ratio

    ratio, st = is_ratio(old, behaviour, mask, "sequence_mask", None, 3.0)
    raw = st["raw_mean"]
    rows = mask.sum(-1) > 0
    log_rho = (old - behaviour).mul(mask).nan_to_num().sum(-1)[rows]
    outside = ((log_rho > math.log(3)) | (log_rho < -math.log(3))).float().mean().item()
    rho = log_rho.exp()
    return {"ratio_mean": rho.mean().item(), "ratio_min": rho.min().item(), "ratio_max": rho.max().item(),
            "masked_at_defaults": st["clipped_frac"], "outside_1/3_3": outside, "raw_mean": raw,
            "abs_log_ratio_per_token": st["logp_diff_mean"], "pi_old_seconds": seconds, "rows": int(rows.sum())}


def measure(shards: Path, model_dir: Path, g: int, groups: int, work: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.grpo_config import PolarGRPOConfig
    from trainer.grpo_trainer import PolarGRPOTrainer

    class Measuring(PolarGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            mask = out["completion_mask"] * out["tool_mask"]
            beh = out["sampling_per_token_logps"]
            t0 = time.perf_counter()
            trunc = self._old_policy_logps(out, self.shard_rollout.batch_transforms)
            t1 = time.perf_counter()
            full = self._policy_logps(out)
            t2 = time.perf_counter()
            self.measured = {"truncation_aware": summarise(trunc, beh, mask, t1 - t0),
                             "full_softmax": summarise(full, beh, mask, t2 - t1),
                             "tokens": int(mask.sum())}
            return out

    args = PolarGRPOConfig(output_dir=str(work / "out"), shards=str(shards), max_steps=1, learning_rate=0.0,
                           per_device_train_batch_size=groups * g, num_generations=g, temperature=0.6,
                           save_strategy="no", report_to="none", use_cpu=True, bf16=False, logging_steps=1,
                           gradient_checkpointing=False, disable_tqdm=True, shard_wait_timeout=30, seed=0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    t = Measuring(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    t.train()
    return t.measured


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-url", default=None, help="a running real vLLM in processed mode serving polar-model")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = ap.parse_args(argv)
    import torch

    from harness_recipes.cache import tiny_model
    from harness_recipes.node.local_stack import VLLM_FLAGS, vllm

    torch.set_num_threads(a.threads)
    model_dir = tiny_model()
    with tempfile.TemporaryDirectory(prefix="bench-is-") as tmp, contextlib.ExitStack() as es:
        work = Path(tmp)
        url = a.vllm_url
        if url is None:
            url = es.enter_context(vllm(model_dir, extra_args=VLLM_FLAGS, log=work / "vllm.log")).url
        shards = collect(url, model_dir, work, a.groups, a.group_size, a.max_tokens)
        res = measure(shards, model_dir, a.group_size, a.groups, work)
    res["setup"] = {"groups": a.groups, "group_size": a.group_size, "max_tokens": a.max_tokens,
                    "sampling": "server defaults (generation_config.json): T=0.6 top_k=20 top_p=0.95",
                    "server": "real vLLM 0.32 CPU, --logprobs-mode processed_logprobs"}
    print(f"{res['tokens']} trainable tokens in {res['truncation_aware']['rows']} rows")
    cols = ("ratio_mean", "ratio_min", "ratio_max", "masked_at_defaults", "outside_1/3_3", "abs_log_ratio_per_token",
            "pi_old_seconds")
    print("| pi_old | " + " | ".join(cols) + " |")
    for k in ("full_softmax", "truncation_aware"):
        print(f"| {k} | " + " | ".join(f"{res[k][c]:.4g}" for c in cols) + " |")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
