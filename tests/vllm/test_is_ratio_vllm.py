"""Importance ratios on real servers (docs/training.md): completions sampled with Qwen3's defaults (the tiny
model's generation_config.json: T=0.6, top_k=20, top_p=0.95, applied by the server to requests that set
none, as Pi and others send) through the real proxy, shards built by polar-recon, then the trainer
(lr 0, TRL's default sequence_mask) forms its ratio with the truncation-aware old-policy log-probs:
mean |log ratio| < 1e-3 and nothing clipped or masked, while the full-softmax ratio of the same tokens is
far from 1 (processed logprobs) or identical (SGLang's scaled logprobs: temperature only).

Servers: the real vLLM 0.32 in processed mode (``POLAR_TEST_VLLM_URL`` or the session's ``real_vllm``),
polar-serve's vllm dialect (``--logprobs-mode processed_logprobs``) and its sglang dialect (scaled)."""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness_recipes.node.local_stack import capture_proxy, serve
from polar_recon.build import Options, build
from tests.conftest import VLLM_MODEL_NAME
from tests.trainer.test_grpo_trainer import config, trainer
from trainer.is_correction import is_ratio

QWEN3 = {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}
GROUPS, GROUP_SIZE, MAX_TOKENS = 4, 2, 8  # top_p < 1 sorts the vocabulary per token on vLLM's CPU path


def post(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"content-type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read() or b"null")


def collect(upstream: str, model_dir: Path, work: Path, option: bool = True) -> Path:
    """GROUPS x GROUP_SIZE one-call episodes through the proxy, no sampling fields (the server's
    defaults apply; the proxy records them from polar_generation_config, or without the option
    from what the server says it serves: addon/sampling_discovery.py); returns the shard dir."""
    sets = {"polar_generation_config": str(model_dir)} if option else {}
    with capture_proxy(upstream, work / "logs", control_secret=None, sets=sets) as px:
        for g in range(GROUPS):
            for e in range(GROUP_SIZE):
                ep = f"g{g}-e{e}"
                post(px.url, "/v1/chat/completions", {
                    "model": VLLM_MODEL_NAME, "max_tokens": MAX_TOKENS, "seed": 100 * g + e,
                    "messages": [{"role": "user", "content": f"Task {g}: name a colour."}]}, {"x-polar-episode": ep})
                post(px.url, f"/polar/{ep}/end", {"reward": float(e), "metadata": {"group_id": f"g{g}"}})
    rep = build(work / "logs", work / "shards", Options(group_size=GROUP_SIZE))
    assert len(rep.built) == GROUPS * GROUP_SIZE and not rep.errors, rep
    return work / "shards"


@pytest.fixture(scope="module")
def vllm_url(request):
    return os.environ.get("POLAR_TEST_VLLM_URL") or request.getfixturevalue("real_vllm").url


def ratios(shards: Path, tiny_dir, tmp_path) -> tuple[dict, dict, list[dict]]:
    """(truncation-aware stats, full-softmax stats, shard rows) from one trainer step at lr 0."""
    rows = pq.read_table(shards).to_pylist()
    t = trainer(tiny_dir, config(tmp_path, shards=str(shards), learning_rate=0.0, temperature=0.6, max_steps=1,
                                 per_device_train_batch_size=GROUPS * GROUP_SIZE, num_generations=GROUP_SIZE))
    t.train()
    out = t.gens[0]
    assert out["completion_ids"].size(0) == GROUPS * GROUP_SIZE
    mask = out["completion_mask"] * out["tool_mask"]
    _, full = is_ratio(t._policy_logps(out), out["sampling_per_token_logps"], mask, "sequence_mask", None, 3.0)
    return out["is_stats"], full, rows


def check_on_policy(st: dict) -> None:
    assert st["logp_diff_mean"] < 1e-3, st
    assert st["clipped_frac"] == 0.0 and 0.99 < st["min"] <= st["max"] < 1.01, st


@pytest.mark.parametrize("option", [True, False], ids=["option", "discovered"])
def test_real_vllm_processed_ratio_is_one(vllm_url, tiny_model, tmp_path, option):
    """With polar_generation_config, and without it (the proxy asks vLLM's /v1/models which model it
    serves and reads its generation_config.json): the same values, and the corrected ratio is 1."""
    st, full, rows = ratios(collect(vllm_url, tiny_model, tmp_path, option), tiny_model, tmp_path)
    assert all({k: r[k] for k in (*QWEN3, "logprobs_mode", "sampling_unsupported")} ==
               {**QWEN3, "logprobs_mode": "processed", "sampling_unsupported": None} for r in rows), rows[0]
    assert all(r["sampling_source"].startswith("option: " if option else "discovered: vllm GET /v1/models root")
               for r in rows), rows[0]["sampling_source"]
    check_on_policy(st)
    # The full softmax: each token's ratio is its kept mass; over MAX_TOKENS tokens the sequence ratio
    # is far below 1.
    assert full["logp_diff_mean"] > 0.05 and full["raw_mean"] < 0.9, full
    print(f"\nreal vLLM processed: truncation-aware {st}\nfull softmax {full}")


@pytest.mark.parametrize("dialect,mode", [("vllm", "processed"), ("sglang", "scaled")])
def test_polar_serve_ratio_is_one(dialect, mode, tiny_model, tmp_path):
    with serve(tiny_model, dialect=dialect, log=tmp_path / "serve.log") as srv:
        shards = collect(srv.url, tiny_model, tmp_path)
    st, full, rows = ratios(shards, tiny_model, tmp_path)
    assert all(r["logprobs_mode"] == mode and r["top_k"] == 20 and r["sampling_unsupported"] is None
               for r in rows), rows[0]
    check_on_policy(st)
    if mode == "processed":
        assert full["logp_diff_mean"] > 0.05 and full["raw_mean"] < 0.9, full
    else:  # scaled logprobs are the full softmax at T: nothing to correct for
        check_on_policy(full)
