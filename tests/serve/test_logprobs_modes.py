"""polar-serve's sampling transform and logprobs modes against their sources of truth:

- processed: vLLM 0.32's own Sampler in processed_logprobs mode (run in the vLLM venv by
  tests/trainer/vllm_sampler_ref.py) on the same logits, for every combination of temperature,
  min_p, top_k and top_p: the same kept tokens and the same log-probabilities (process_logits, the
  teacher-forcing path, and _candidates, the sampling path);
- raw (vLLM's default) and scaled (SGLang 0.5.23's sampler: log(softmax(logits / T)), untruncated)
  computed from their definitions;
- the command line: the flags' names, defaults and refusals, and --generation-config.
"""
from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
import torch

from polar_serve.model import SamplingParams, _candidates, reported_row, sample_step

REF = Path(__file__).resolve().parents[1] / "trainer" / "vllm_sampler_ref.py"
COMBOS = [dict(temperature=t, top_k=k, top_p=p, min_p=m)
          for t, k, p, m in itertools.product((0.6, 1.0, 1.7), (-1, 1, 20), (1.0, 0.95, 0.5), (0.0, 0.05, 0.3))]


def _logits(n: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 6.0, n).unsqueeze(1)  # from a flat to a peaked distribution
    return (torch.randn(n, v, generator=g) * scale).float()


@pytest.fixture(scope="module")
def vllm_truth(tmp_path_factory):
    from harness_recipes.cache import vllm_python

    python = vllm_python()
    if not python.exists():
        pytest.skip(f"the real vLLM is not installed at {python}: run `make vllm`")
    if not REF.exists():
        pytest.skip(f"{REF} (vLLM's Sampler runner) is missing")
    d = tmp_path_factory.mktemp("ref")
    logits = _logits(len(COMBOS), 2000)
    torch.save({"logits": logits, **{k: [c[k] for c in COMBOS] for k in ("temperature", "top_k", "top_p", "min_p")},
                "seed": 0, "draws": 0}, d / "in.pt")
    r = subprocess.run([str(python), str(REF), str(d / "in.pt"), str(d / "out.pt")], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return logits, torch.load(d / "out.pt")["logprobs"]


def test_processed_logprobs_are_vllms(vllm_truth):
    """Every row: the tokens polar-serve keeps are vLLM's, with vLLM's processed logprobs (1e-5)."""
    logits, want = vllm_truth
    for i, c in enumerate(COMBOS):
        p = SamplingParams(**c)
        got = reported_row(logits[i], p, "processed")
        kept_want = torch.isfinite(want[i]) & (want[i] > -1e30)
        kept_got = torch.isfinite(got)
        assert torch.equal(kept_got, kept_want), (c, int(kept_got.sum()), int(kept_want.sum()))
        assert torch.allclose(got[kept_got], want[i][kept_want], atol=1e-5), c
        vals, idx = _candidates(logits[i] / p.temperature, p)
        ids = set(range(logits.shape[1])) if idx is None else set(idx.tolist())
        assert ids == set(torch.nonzero(kept_want).flatten().tolist()), c
        if idx is not None:
            assert torch.allclose(torch.log_softmax(vals, -1), want[i][idx], atol=1e-5), c


def test_the_order_matters_min_p_before_top_p():
    """The case that tells vLLM's order (min_p, then top_p on what is left) from the other one:
    probabilities 0.5, 0.3, 0.15, 0.05; min_p 0.2 drops 0.05 (< 0.1) and renormalises, then
    top_p 0.8 keeps tokens until the mass before them reaches 0.8 of the renormalised rest."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = SamplingParams(temperature=1.0, top_p=0.8, min_p=0.2)
    row = reported_row(probs.log(), p, "processed")
    # after min_p: 0.526, 0.316, 0.158; vLLM ascending cumsum: 0.158 <= 0.2 dropped, 0.474 kept
    assert torch.isfinite(row).tolist() == [True, True, False, False]
    assert torch.allclose(row[:2].exp(), torch.tensor([0.625, 0.375]), atol=1e-6)


def test_raw_and_scaled_are_their_definitions():
    logits = _logits(1, 500, seed=3)[0]
    p = SamplingParams(temperature=0.6, top_k=20, top_p=0.95)
    assert torch.allclose(reported_row(logits, p, "raw"), torch.log_softmax(logits, -1))
    assert torch.allclose(reported_row(logits, p, "scaled"), torch.log_softmax(logits / 0.6, -1))
    greedy = SamplingParams(temperature=0.0, top_k=20)
    for mode in ("raw", "scaled", "processed"):
        assert torch.allclose(reported_row(logits, greedy, mode), torch.log_softmax(logits, -1))
    # a sampled step reports the mode's logprob of the token it sampled (from the processed set)
    g = torch.Generator().manual_seed(1)
    for mode in ("raw", "scaled", "processed"):
        st = sample_step(logits, SamplingParams(temperature=0.6, top_k=20, top_logprobs=2), g, mode)
        row = reported_row(logits, SamplingParams(temperature=0.6, top_k=20), mode)
        assert abs(st.logprob - float(row[st.token_id])) < 1e-5
        assert [i for i, _ in st.top] == torch.topk(row, 2).indices.tolist()
        assert st.token_id in torch.topk(logits, 20).indices.tolist()


def _cli(*args, timeout=60):
    import sys
    return subprocess.run([sys.executable, "-m", "polar_serve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_flags_are_the_real_servers(tiny_model, tmp_path):
    from polar_serve.cli import _parser, _sampling_setup

    def setup(*a):
        return _sampling_setup(_parser().parse_args(["--model", "m", *a]))
    assert setup() == ("raw", "auto")  # vLLM's defaults
    assert setup("--logprobs-mode", "processed_logprobs", "--generation-config", "vllm") == ("processed", "vllm")
    assert setup("--dialect", "sglang") == ("scaled", "auto")
    assert setup("--dialect", "sglang", "--sampling-defaults", "openai") == ("scaled", "vllm")
    assert setup("--generation-config", str(tiny_model)) == ("raw", str(tiny_model))
    for bad, msg in ((["--dialect", "sglang", "--logprobs-mode", "raw_logprobs"], "vLLM flags"),
                     (["--sampling-defaults", "openai"], "SGLang's flag"),
                     (["--generation-config", str(tmp_path)], "generation_config.json")):
        with pytest.raises(ValueError, match=msg):
            setup(*bad)
    r = _cli("--model", str(tiny_model), "--dialect", "sglang", "--logprobs-mode", "raw_logprobs")
    assert r.returncode == 2 and "vLLM flags" in r.stderr


def test_generation_config_decides_the_defaults(tiny_model):
    from polar_serve.model import ServedModel

    assert ServedModel(tiny_model).gen_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert ServedModel(tiny_model, generation_config="vllm").gen_defaults == {}
    with pytest.raises(ValueError, match="logprobs_mode"):
        ServedModel(tiny_model, logprobs_mode="raw_logprobs")
