"""trainer/behaviour_logprobs.py: the truncation-aware log-probs against vLLM 0.32's own Sampler (run in the vLLM
venv on the same logits), against a per-position reference written from the rules, and against the
token frequencies vLLM's sampler draws; the row -> transform rules (refusals, exclusions)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from trainer.behaviour_logprobs import FIX, LogprobsModeError, Transform, mask_logits_, row_transform, token_logprobs

HERE = Path(__file__).parent
VLLM_PY = Path(os.environ.get("POLAR_CACHE", HERE.parents[1] / ".cache")) / "vllm-venv" / "bin" / "python"


def vllm_sampler(tmp_path, logits, temperature, top_k, top_p, min_p, draws=0, seed=0) -> dict:
    if not VLLM_PY.exists():
        if os.environ.get("POLAR_NO_SKIP") == "1":
            raise AssertionError(f"{VLLM_PY} missing (make vllm)")
        pytest.skip(f"vLLM venv not built ({VLLM_PY} missing): make vllm")
    src, dst = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save({"logits": logits, "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                "draws": draws, "seed": seed}, src)
    r = subprocess.run([str(VLLM_PY), str(HERE / "vllm_sampler_ref.py"), str(src), str(dst)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(dst)


def all_logprobs(logits_row: torch.Tensor, t: Transform) -> torch.Tensor:
    """log p of every token of one position under t (token_logprobs for each, without V copies of the row)."""
    z = logits_row[None].float() / t.temperature
    if t.truncates:
        mask_logits_(z, t)
    return z.log_softmax(-1)[0]


def test_token_logprobs_is_all_logprobs_gathered():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(9, 300, generator=g) * 3
    toks = torch.randint(0, 300, (9,), generator=g)
    for t in (Transform(0.6, 20, 0.95), Transform(1.0, -1, 0.7, 0.05), Transform(0.8)):
        got = token_logprobs(logits, toks, t, chunk=4, keep_sampled=False)  # (the sampled-token rule: test_numerics)
        want = torch.stack([all_logprobs(logits[i], t)[toks[i]] for i in range(9)])
        assert close(got, want)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> bool:
    """Same masked (-inf) entries, the rest within atol."""
    fin = torch.isfinite(b)
    return torch.equal(torch.isfinite(a), fin) and bool(((a[fin] - b[fin]).abs() <= atol).all())


def transform(temperature, k, p, m) -> Transform:
    return Transform(temperature if temperature >= 1e-5 else 1.0, k, p, m)


CASES = [  # temperature, top_k, top_p, min_p
    (0.6, 20, 0.95, 0.0),  # Qwen3's generation_config.json
    (1.0, -1, 0.9, 0.0),
    (0.6, 5, 1.0, 0.0),
    (0.7, -1, 1.0, 0.05),
    (0.8, 50, 0.8, 0.02),
    (1.0, -1, 1.0, 0.0),
    (0.0, -1, 1.0, 0.0),  # greedy in a mixed batch: unscaled, untruncated
    (1.3, 3, 0.5, 0.0),
]


def test_matches_vllm_sampler_processed_logprobs(tmp_path):
    g = torch.Generator().manual_seed(0)
    v = 3000
    logits = torch.randn(len(CASES), v, generator=g) * 4
    logits[2, :40] = logits[2].max()  # ties at the k-th value: vLLM keeps them all
    logits[4] = (logits[4] * 2).round() / 2  # many ties
    cols = list(zip(*CASES))
    ref = vllm_sampler(tmp_path, logits, *map(list, cols))["logprobs"]
    for i, case in enumerate(CASES):
        mine = all_logprobs(logits[i], transform(*case))
        kept = torch.isfinite(ref[i])
        assert torch.equal(torch.isfinite(mine), kept), (case, int(kept.sum()), int(torch.isfinite(mine).sum()))
        assert (mine[kept] - ref[i][kept]).abs().max() < 1e-5, case
        if transform(*case).truncates:
            assert kept.sum() < v, case  # the case really truncates


def test_all_greedy_batch_reports_unscaled_logprobs(tmp_path):
    """vLLM's all-greedy path (sampler.py:264-273) returns log_softmax of the raw logits: temperature 1."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 500, generator=g) * 3
    ref = vllm_sampler(tmp_path, logits, [0.0, 0.0], [-1, -1], [1.0, 1.0], [0.0, 0.0])["logprobs"]
    for i in range(2):
        assert close(all_logprobs(logits[i], row_transform(row(temperature=0.0), 0.6)[0]), ref[i])


def test_qwen3_vocab_one_position_matches_vllm(tmp_path):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 151936, generator=g) * 3
    ref = vllm_sampler(tmp_path, logits, [0.6, 0.6], [20, -1], [0.95, 0.95], [0.0, 0.0])["logprobs"]
    for i, k in enumerate((20, -1)):
        mine = all_logprobs(logits[i], Transform(0.6, k, 0.95))
        kept = torch.isfinite(ref[i])
        assert torch.equal(torch.isfinite(mine), kept)
        assert (mine[kept] - ref[i][kept]).abs().max() < 1e-5


def test_frequencies_of_vllm_draws_follow_the_transform(tmp_path):
    """vLLM's sampler draws tokens from exactly the distribution whose log-probs we compute."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 60, generator=g) * 2
    case = (0.6, 20, 0.95, 0.0)
    draws = 3000
    out = vllm_sampler(tmp_path, logits.expand(4, 60).contiguous(), *[[c] * 4 for c in case], draws=draws // 4)
    counts = torch.bincount(out["samples"].flatten(), minlength=60).double()
    p = all_logprobs(logits[0], Transform(0.6, 20, 0.95)).exp().double()
    n = counts.sum()
    assert counts[p == 0].sum() == 0  # nothing outside the kept set is ever drawn
    se = (p * (1 - p) / n).sqrt()
    z = ((counts / n - p).abs() / se.clamp_min(1e-12))[p > 0]
    assert z.max() < 5, z.max()  # ~20 kept tokens, 5 sigma
    full = torch.softmax(logits[0] / 0.6, -1).double()
    assert ((counts / n - full).abs() / (full * (1 - full) / n).sqrt()).max() > 5  # the untruncated one is wrong


def reference_logprob(logits: list[float], tok: int, t: Transform) -> float:
    """Per position, from the rules as words: scale; min_p vs the max probability; keep the tokens >= the
    k-th largest logit; walking down from the largest, keep a token while the mass above it is < top_p."""
    z = [x / t.temperature for x in logits]
    keep = [True] * len(z)
    if t.min_p > 0:
        m = max(z)
        lse = m + math.log(sum(math.exp(x - m) for x in z))
        pmax = math.exp(m - lse)
        keep = [math.exp(x - lse) >= pmax * t.min_p for x in z]
    if 0 < t.top_k < len(z):
        kth = sorted((x for x, k in zip(z, keep) if k), reverse=True)
        kth = kth[min(t.top_k, len(kth)) - 1]
        keep = [k and x >= kth for x, k in zip(z, keep)]
    if t.top_p < 1:
        kept = [x for x, k in zip(z, keep) if k]
        m = max(kept)
        s = sum(math.exp(x - m) for x in kept)
        above = 0.0
        for i in sorted((i for i in range(len(z)) if keep[i]), key=lambda i: -z[i]):
            pi = math.exp(z[i] - m) / s
            assume(abs(above - t.top_p) > 1e-4)  # float32 vs float64 at the boundary: not a rule question
            if above >= t.top_p:
                keep[i] = False
            above += pi
        # ties straddling the boundary are ordered arbitrarily by any sort: not a rule question either
        boundary = [z[i] for i in range(len(z)) if keep[i]]
        assume(not any(z[i] == min(boundary) for i in range(len(z)) if not keep[i]))
    if not keep[tok]:
        return -math.inf
    kept = [x for x, k in zip(z, keep) if k]
    m = max(kept)
    return z[tok] - (m + math.log(sum(math.exp(x - m) for x in kept)))


@settings(max_examples=150, deadline=None)
@given(logits=st.lists(st.integers(-12, 12), min_size=2, max_size=40),
       temperature=st.sampled_from([0.3, 0.6, 1.0, 1.7]), top_k=st.integers(-1, 45),
       top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]), min_p=st.sampled_from([0.0, 0.0, 0.05, 0.3]),
       chunk=st.integers(1, 50))
def test_property_matches_per_position_reference(logits, temperature, top_k, top_p, min_p, chunk):
    x = [v / 3 for v in logits]  # integer grid: plenty of ties
    t = Transform(temperature, top_k if top_k > 0 else -1, top_p, min_p)
    mine = all_logprobs(torch.tensor(x), t)
    toks = torch.arange(len(x))
    assert close(token_logprobs(torch.tensor(x).expand(len(x), len(x)), toks, t, chunk=chunk, keep_sampled=False), mine)
    for tok in range(len(x)):
        want = reference_logprob(x, tok, t)
        got = float(mine[tok])
        assert (want == -math.inf and got == -math.inf) or abs(got - want) < 1e-4, (tok, got, want)
    assert abs(float(torch.logsumexp(mine, 0))) < 1e-5  # renormalised


def test_input_logits_untouched_and_chunking_invariant():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 500, generator=g)
    before = logits.clone()
    toks = torch.randint(0, 500, (37,), generator=g)
    t = Transform(0.6, 20, 0.95)
    a = token_logprobs(logits, toks, t, chunk=1)
    b = token_logprobs(logits, toks, t, chunk=1000)
    assert torch.equal(logits, before) and torch.equal(a, b)
    z = logits / 0.6
    assert torch.equal(mask_logits_(z.clone(), Transform(0.6)), z)  # no truncation: nothing masked


def row(**kw):
    return {"episode_id": "ep", "temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
            "logprobs_mode": "processed", "sampling_unsupported": None, **kw}


def test_row_transform_rules():
    assert row_transform(row(), 1.0) == (Transform(0.6, 20, 0.95, 0.0), "")
    assert row_transform(row(top_k=0), 1.0)[0].top_k == -1
    assert row_transform(row(logprobs_mode="scaled"), 1.0) == (Transform(0.6), "")  # SGLang: before truncation
    assert row_transform(row(temperature=0.0, top_k=-1, top_p=1.0), 1.0) == (Transform(1.0), "")  # greedy
    assert row_transform(row(temperature=None), 0.7)[0] == Transform(0.7, 20, 0.95)  # old shards' default
    t, why = row_transform(row(sampling_unsupported="presence_penalty=0.5; logit_bias"), 1.0)
    assert t is None and "presence_penalty=0.5; logit_bias" in why
    t, why = row_transform(row(top_p=None), 1.0)
    assert t is None and "top_p" in why and "null" in why


@pytest.mark.parametrize("mode,what", [("raw", "raw logprobs"), (None, "unknown mode")])
def test_row_transform_refuses_raw_and_unknown_modes(mode, what):
    with pytest.raises(LogprobsModeError, match=what) as e:
        row_transform(row(logprobs_mode=mode), 1.0, "shard-000001.parquet row 3")
    assert "--logprobs-mode processed_logprobs" in str(e.value) and "row 3" in str(e.value)
    r = row()
    del r["logprobs_mode"]  # a shard older than the column
    with pytest.raises(LogprobsModeError, match="unknown mode"):
        row_transform(r, 1.0)
    assert "vllm serve" in FIX


def test_raw_rows_are_accepted_only_when_the_sampling_is_the_identity():
    plain = dict(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, logprobs_mode="raw")
    assert row_transform(row(**plain), 0.6) == (Transform(1.0), "")  # raw == processed here
    assert row_transform(row(**{**plain, "temperature": 0.0}), 0.6) == (Transform(1.0), "")  # greedy: unscaled
    for other in ({"temperature": 0.6}, {"top_k": 20}, {"top_p": 0.95}, {"min_p": 0.05}, {"temperature": None},
                  {"top_k": None}, {"sampling_unsupported": "presence_penalty=0.5"}):
        with pytest.raises(LogprobsModeError, match="raw logprobs"):
            row_transform(row(**{**plain, **other}), 1.0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
