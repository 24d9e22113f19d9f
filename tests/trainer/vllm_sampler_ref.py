"""Run under the vLLM venv (.cache/vllm-venv/bin/python): vLLM 0.32's own Sampler, in
processed_logprobs mode, on given logits and per-row sampling parameters; writes the processed
logprobs (N, V) it would report and the tokens it samples. The ground truth for trainer/behaviour_logprobs.py.

    python vllm_sampler_ref.py IN.pt OUT.pt

IN.pt: {"logits": (N, V) float32, "temperature": [N], "top_k": [N] (-1 off), "top_p": [N], "min_p": [N],
        "seed": int, "draws": int}
OUT.pt: {"logprobs": (N, V), "samples": (draws, N) int64}
"""
import sys
from types import SimpleNamespace

import torch
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler


def main(src, dst):
    d = torch.load(src)
    logits = d["logits"].float()
    n, v = logits.shape
    temp = torch.tensor(d["temperature"], dtype=torch.float32)
    # vLLM's input batch: top_k off -> vocab size (gpu_input_batch.py:407-412); top_p off -> 1.0.
    k = torch.tensor([kk if 0 < kk < v else v for kk in d["top_k"]], dtype=torch.int32)
    p = torch.tensor(d["top_p"], dtype=torch.float32)
    procs = []
    if any(m > 0 for m in d["min_p"]):
        minp = MinPLogitsProcessor(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=n)), "cpu", False)
        minp.min_p_count = sum(m > 0 for m in d["min_p"])
        minp.min_p = torch.tensor(d["min_p"], dtype=torch.float32).unsqueeze(1)
        procs.append(minp)
    greedy = temp < 1e-5
    sampler = Sampler(logprobs_mode="processed_logprobs")
    torch.manual_seed(d.get("seed", 0))

    def meta():
        return SamplingMetadata(
            temperature=temp, all_greedy=bool(greedy.all()), all_random=not bool(greedy.any()),
            top_p=None if bool((p >= 1).all()) else p, top_k=None if bool((k >= v).all()) else k,
            generators={}, max_num_logprobs=0, no_penalties=True, prompt_token_ids=None,
            frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n),
            repetition_penalties=torch.ones(n), output_token_ids=[[] for _ in range(n)],
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(procs))

    _, lp = sampler.sample(logits.clone(), meta())
    samples = [sampler.sample(logits.clone(), meta())[0].long() for _ in range(d.get("draws", 0))]
    torch.save({"logprobs": lp, "samples": torch.stack(samples) if samples else torch.empty(0, n)}, dst)


if __name__ == "__main__":
    main(*sys.argv[1:])
