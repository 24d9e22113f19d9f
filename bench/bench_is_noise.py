"""The importance ratio when the trainer's numerics differ from the server's (docs/training.md,
"Importance-sampling correction"): recorded rows,
the trainer's logits perturbed at bf16 level, pi_old under the OLD rule (the trainer's recomputed
top-k/top-p/min-p set only: a sampled token outside it gets -inf) and the NEW one (the sampled token
always kept, trainer/behaviour_logprobs.py ``sampled_token_logprobs``; non-finite tokens masked and
counted, trainer/is_correction.py), side by side.

    PYTHONPATH=. .venv/bin/python bench/bench_is_noise.py [--groups 16] [--group-size 4] [--max-tokens 64] \
        [--draws 2] [--vllm-url URL] [--json out.json]

Rows: one chat call per episode through the capture proxy (addon) to polar-serve's vllm dialect with
``--logprobs-mode processed_logprobs`` (its sampler is held to vLLM 0.32's: tests/trainer/vllm_sampler_ref.py),
or to a running real vLLM (``--vllm-url``, local_stack.VLLM_FLAGS); requests carry no sampling field, so the
server applies the tiny Qwen3's generation_config.json (Qwen3's defaults: T=0.6, top_k=20, top_p=0.95);
polar-recon builds the shards. The trainer's side: the same model in float32 (on-policy), its logits at
every trainable position, then per condition:

- ``exact``: the logits as computed (the trainer's fp32 forward; the server's is fp32 too);
- ``noise σ``: + N(0, σ²) per logit (σ 0.01 and 0.03: the bf16-vs-fp32 / kernel / batch-shape gap), ``--draws``
  independent draws;
- ``bf16 logits``: the logits rounded to bfloat16 and back;
- ``bf16 weights``: every weight rounded to bfloat16 and back, then the fp32 forward.

Per condition and rule: tokens whose pi_old is -inf (masked), tokens whose sampled token had to be added to
the kept set (new rule), the sequence ratio exp(sum log pi_old - log mu) mean / min, |mean - 1|, the share of
sequences with ratio < 1e-6 (zeroed), the share outside [1/3, 3] (TRL's sequence_mask at clip_max 3 masks >3;
a ratio near 0 zeroes the advantage just the same), and the mean |log ratio| per finite token.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("POLAR_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))


def load_rows(shards: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for f in sorted(shards.glob("shard-*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def trainer_logits(model, rows: list[dict]):
    """Per row: (logits at the trainable positions (n, V) float32, sampled tokens (n,), behaviour logprobs (n,))."""
    import torch

    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r["input_ids"]])
            pos = torch.tensor([i for i, m in enumerate(r["loss_mask"]) if m and i >= r["prompt_len"]])
            logits = model(input_ids=ids).logits[0].float()
            out.append((logits[pos - 1].clone(), ids[0, pos], torch.tensor(r["logprobs"], dtype=torch.float32)[pos]))
    return out


def evaluate(per_row, transforms, perturb) -> dict:
    """Both rules on the perturbed logits of every row (one perturbation per row, shared by the rules)."""
    import torch

    from trainer.behaviour_logprobs import sampled_token_logprobs

    acc = {rule: {"n_tok": 0, "n_inf": 0, "n_added": 0, "log_rhos": [], "absdiffs": []} for rule in ("before", "after")}
    for (logits, toks, beh), t in zip(per_row, transforms):
        z = perturb(logits)
        for rule, keep in (("before", False), ("after", True)):
            a = acc[rule]
            lp, added = sampled_token_logprobs(z, toks, t, keep_sampled=keep)
            diff = lp - beh
            finite = torch.isfinite(diff)
            a["n_tok"] += diff.numel()
            a["n_inf"] += int((~finite).sum())
            a["n_added"] += int(added.sum())
            a["absdiffs"].append(diff[finite].abs())
            # before: what is_correction.py did (nan_to_num of -inf: the sequence's ratio is 0);
            # after: a non-finite token is masked out of the loss and the ratio (is_correction.py)
            a["log_rhos"].append(float(torch.nan_to_num(diff).sum()) if not keep else float(diff[finite].sum()))
    res = {}
    for rule, a in acc.items():
        rho = torch.tensor(a["log_rhos"], dtype=torch.float64).exp()
        n = a["n_tok"]
        res[rule] = {"tokens": n, "masked_token_share": a["n_inf"] / n, "kept_set_fix_share": a["n_added"] / n,
                     "seq_ratio_mean": float(rho.mean()), "seq_ratio_min": float(rho.min()),
                     "seq_ratio_mean_err": abs(float(rho.mean()) - 1.0),
                     "seq_zeroed_share": float((rho < 1e-6).double().mean()),
                     "seq_outside_1/3_3": float(((rho < 1 / 3) | (rho > 3)).double().mean()),
                     "abs_log_ratio_per_token": float(torch.cat(a["absdiffs"]).mean())}
    return res


def merge(draws: list[dict]) -> dict:
    """Mean over noise draws (min: the smallest)."""
    out = {}
    for rule in draws[0]:
        out[rule] = {k: (min(d[rule][k] for d in draws) if k == "seq_ratio_min" else
                         sum(d[rule][k] for d in draws) / len(draws)) for k in draws[0][rule]}
    return out


def measure(shards: Path, model_dir: Path, draws: int, temperature_default: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.row_exclusions import resolve_row

    rows = load_rows(shards)
    transforms = []
    for r in rows:
        t, reason, detail = resolve_row(r, trainer_temperature=None, served_default_temperature=temperature_default,
                                        is_correction=True, max_realign_share=None)
        if t is None:
            raise RuntimeError(f"row of {r['episode_id']} excluded: {reason}: {detail}")
        transforms.append(t)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    per_row = trainer_logits(model, rows)
    res = {"rows": len(rows), "transforms": sorted({str(t) for t in transforms}),
           "exact": evaluate(per_row, transforms, lambda x: x)}
    for sigma in (0.01, 0.03):
        gens = [torch.Generator().manual_seed(1000 + d) for d in range(draws)]
        res[f"noise {sigma}"] = merge([evaluate(per_row, transforms, lambda x, g=g, s=sigma: x + s * torch.randn(
            x.shape, generator=g)) for g in gens])
    res["bf16 logits"] = evaluate(per_row, transforms, lambda x: x.bfloat16().float())
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    res["bf16 weights"] = evaluate(trainer_logits(model, rows), transforms, lambda x: x)
    return res


COLS = ("masked_token_share", "kept_set_fix_share", "seq_ratio_mean", "seq_ratio_min", "seq_zeroed_share",
        "seq_outside_1/3_3", "abs_log_ratio_per_token")


def table(res: dict) -> str:
    lines = ["| condition | rule | " + " | ".join(COLS) + " |", "|---" * (len(COLS) + 2) + "|"]
    for cond, v in res.items():
        if not isinstance(v, dict) or "before" not in v:
            continue
        for rule in ("before", "after"):
            lines.append(f"| {cond} | {rule} | " + " | ".join(f"{v[rule][c]:.4g}" for c in COLS) + " |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-url", default=None, help="a running real vLLM (processed logprobs) serving polar-model")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--draws", type=int, default=2, help="noise draws per sigma")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch
    from bench_is_ratio import collect

    from harness_recipes.cache import tiny_model
    from harness_recipes.node.local_stack import serve
    from trainer.row_temperature import generation_default

    torch.set_num_threads(a.threads)
    model_dir = tiny_model()
    with tempfile.TemporaryDirectory(prefix="bench-is-noise-") as tmp, contextlib.ExitStack() as es:
        work = Path(tmp)
        url, server = a.vllm_url, "real vLLM (--vllm-url), processed logprobs"
        if url is None:
            url = es.enter_context(serve(model_dir, log=work / "serve.log")).url
            server = "polar-serve, vllm dialect, --logprobs-mode processed_logprobs"
        shards = collect(url, model_dir, work, a.groups, a.group_size, a.max_tokens)
        res = measure(shards, model_dir, a.draws, generation_default(str(model_dir)))
    res["setup"] = {"server": server, "groups": a.groups, "group_size": a.group_size, "max_tokens": a.max_tokens,
                    "draws": a.draws, "sampling": "server defaults (generation_config.json): T=0.6 top_k=20 top_p=0.95"}
    print(json.dumps(res["setup"]))
    print(table(res))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
