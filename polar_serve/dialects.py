"""The dialects polar-serve speaks, by the name `--dialect` takes."""
from __future__ import annotations

from polar_serve.dialect_base import Dialect

from .dialect_sglang import SGLang
from .dialect_vllm import VLLM

DIALECTS: dict[str, Dialect] = {d.name: d for d in (VLLM(), SGLang())}
