"""The fast Qwen3 forward, prefix cache and logprobs against transformers' own forward pass."""
from __future__ import annotations

import pytest
import torch

from polar_serve.model import LOGPROB_FLOOR, SamplingParams, ServedModel, process_logits


@pytest.fixture(scope="module")
def model(tiny_model):
    return ServedModel(tiny_model)


def _ref_logprobs(model, ids, temperature=1.0):
    with torch.inference_mode():
        logits = model.hf(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits / temperature, -1)


def test_fast_forward_matches_transformers(model):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151000, (360,), generator=g).tolist()
    with torch.inference_mode():
        ref = model.hf(input_ids=torch.tensor([ids])).logits[0]
        cache = model.runner.new_cache()
        h1 = model.runner.forward(cache, ids[:200])           # cold: one causal call
        h2 = model.runner.forward(cache, ids[200:350])        # extension: masked chunk
        h3 = model.runner.forward(cache, ids[350:], keep_last=2)  # last layer only on 2 rows
        got = model.runner.logits(torch.cat([h1, h2]))
        assert torch.allclose(got, ref[:350], atol=1e-4)
        assert torch.allclose(model.runner.logits(h3), ref[-2:], atol=1e-4)


def test_teacher_force_logprobs_match_a_direct_forward(model):
    prompt = model.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    forced = model.tokenizer.encode("<think>\n\n</think>\n\nHello there.") + [model.eos_ids[0]]
    steps = model.teacher_force(prompt, forced, SamplingParams(temperature=0.7, top_logprobs=3))
    ref = _ref_logprobs(model, prompt + forced, 0.7)
    for i, st in enumerate(steps):
        row = ref[len(prompt) - 1 + i]
        assert st.token_id == forced[i]
        assert st.logprob == pytest.approx(float(row[forced[i]]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [t for t, _ in st.top] == top.indices.tolist()


def test_sampled_logprobs_are_processed_logprobs_of_the_sampled_tokens(model):
    prompt = model.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=6, seed=3, ignore_eos=True)
    steps = list(model.generate(prompt, p))
    assert len(steps) == 6
    ids = [s.token_id for s in steps]
    with torch.inference_mode():
        logits = model.hf(input_ids=torch.tensor([prompt + ids])).logits[0]
    for i, st in enumerate(steps):
        lp = torch.log_softmax(process_logits(logits[len(prompt) - 1 + i], p), -1)
        assert st.logprob == pytest.approx(max(float(lp[st.token_id]), LOGPROB_FLOOR), abs=1e-4)
        assert st.logprob > LOGPROB_FLOOR  # a sampled token is never masked out


def test_seed_makes_sampling_reproducible_and_prefix_cache_is_transparent(model):
    prompt = model.tokenizer.encode("<|im_start|>user\nseeded<|im_end|>\n<|im_start|>assistant\n")
    p = SamplingParams(temperature=1.0, max_tokens=8, seed=11, ignore_eos=True)
    a = [s.token_id for s in model.generate(prompt, p)]      # cold
    b = [s.token_id for s in model.generate(prompt, p)]      # prefix cache hit
    model.caches.clear()
    c = [s.token_id for s in model.generate(prompt, p)]
    assert a == b == c


def test_greedy_is_argmax(model):
    prompt = model.tokenizer.encode("<|im_start|>user\ngreedy<|im_end|>\n")
    st = next(iter(model.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))))
    ref = _ref_logprobs(model, prompt)[-1]
    assert st.token_id == int(torch.argmax(ref))
