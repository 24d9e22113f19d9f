"""Synthetic episode logs for the reconstruction tests (the tests' `L.` prefix): the generators are
polar_recon.testing (the benchmarks use them too); REPO is this checkout."""
from __future__ import annotations

from pathlib import Path

from polar_recon.testing import (
    HARNESSES,
    TOKENIZER_DIR,
    Conversation,
    Sample,
    auxiliary_call,
    encode,
    episode,
    render,
    tokenizer,
    two_tool_turns,
    write_tool,
)

__all__ = ["HARNESSES", "REPO", "TOKENIZER_DIR", "Conversation", "Sample", "auxiliary_call", "encode", "episode",
           "render", "tokenizer", "two_tool_turns", "write_tool"]

REPO = Path(__file__).resolve().parents[2]
