"""A copy of a model directory with perturbed weights (same architecture, same tokenizer): what a
weight sync loads in tests and in bench/bench_weight_sync.py, so the served logprobs visibly change."""
from __future__ import annotations

import shutil
from pathlib import Path


def perturbed_copy(src: str | Path, dst: str | Path, *, scale: float = 0.05, seed: int = 1) -> Path:
    """``dst``: every file of ``src``, with Gaussian noise (``scale`` x each tensor's std) added to every
    floating-point tensor of its ``*.safetensors`` files. Written under a temporary name, then renamed."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(tmp.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            meta = st.metadata() or {"format": "pt"}
            tensors = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118 - safe_open is not a dict
        for k, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                tensors[k] = (t.float() + scale * float(t.float().std()) * noise).to(t.dtype).contiguous()
        save_file(tensors, str(f), metadata=meta)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)
    return dst
