"""Build a tiny random Qwen3ForCausalLM that carries the REAL Qwen3 tokenizer and chat template.

A random model cannot drive a harness, but it has the real vocabulary (151936 ids), the real
special tokens and the real template, so every token id, prompt render and logprob the server
reports is of the same shape and meaning as with a real Qwen3 checkpoint. Weights come from a
fixed seed, so the same seed gives byte-identical safetensors.
"""
from __future__ import annotations

import fcntl
import json
import shutil
from pathlib import Path

import torch

from polar_contracts.assets import QWEN3_TOKENIZER

# The real tokenizer is bundled data (polar_data, copied from Qwen/Qwen3-0.6B: see its PROVENANCE.md).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "LICENSE", "PROVENANCE.md")

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)


def make_tiny(out_dir: str | Path, seed: int = 0, tokenizer_dir: str | Path = QWEN3_TOKENIZER) -> Path:
    """Write config, safetensors weights and the real tokenizer files to `out_dir`; return it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    tok_dir = Path(tokenizer_dir)
    if not (tok_dir / "tokenizer.json").is_file():
        raise FileNotFoundError(f"tokenizer.json not found in {tok_dir} (the real Qwen3 tokenizer is required)")
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Qwen3Config(**TINY_CONFIG, torch_dtype="float32")
    model = Qwen3ForCausalLM(config)
    # Larger-than-default init so sampled text is varied rather than near-uniform noise.
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = tok_dir / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    (out / "polar_tiny.json").write_text(json.dumps({"seed": seed, "config": TINY_CONFIG}, indent=1) + "\n")
    return out


def ensure_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny model into out_dir once (file lock: parallel test processes and the demo
    share the cache); a `.complete` marker says the build finished."""
    out = Path(out_dir)
    done = out / ".complete"
    if done.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            make_tiny(out, seed=seed)
            done.write_text("ok\n")
    return out
