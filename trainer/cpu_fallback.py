"""No accelerator: train on the CPU in fp32 instead of failing.

TRL's GRPOConfig defaults ``bf16`` to True, which TrainingArguments refuses on a machine without a GPU
("Your setup doesn't support bf16/gpu"). When the user chose neither ``bf16``/``fp16`` nor
``use_cpu`` and torch sees no accelerator, PolarGRPOConfig picks the CPU and fp32 and says so in one
line, so the README's ``polar-train`` line runs as written on a laptop.
"""
from __future__ import annotations

import sys


def accelerator_present() -> bool:
    """Whether torch sees a device TrainingArguments would train on (CUDA/ROCm, XPU, MPS, XLA)."""
    import torch
    from transformers.utils import is_torch_xla_available

    if torch.cuda.is_available() or is_torch_xla_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def fall_back_to_cpu(cfg) -> bool:
    """Set use_cpu and fp32 on ``cfg`` (before TrainingArguments' checks) when there is no accelerator and
    the user did not choose the precision or the device; return whether it did."""
    if cfg.use_cpu or cfg.bf16 is not None or cfg.fp16 or accelerator_present():
        return False
    cfg.use_cpu, cfg.bf16 = True, False
    print("polar-train: no GPU found: training on the CPU in fp32 (use_cpu=True, bf16=False; pass --bf16 or "
          "--use_cpu to choose)", file=sys.stderr, flush=True)
    return True
