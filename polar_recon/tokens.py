"""The tokenizer facts reconstruction needs: the ids that delimit chat turns (`TurnMarkers`, read
from tokenizer.json, never assumed) and decoding ids to text to classify a re-rendered turn.

Linking (link.py), fidelity checks, strategies, the diagnostics and the HTML view all take a
`TurnMarkers`; `DEFAULT_TOKENIZER` is the bundled Qwen3 tokenizer.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from polar_contracts.assets import QWEN3_TOKENIZER
from polar_recon import bytedecode

DEFAULT_TOKENIZER = QWEN3_TOKENIZER


@dataclass(frozen=True)
class TurnMarkers:
    """Token ids that delimit chat turns: read from the tokenizer, never assumed."""

    start: int  # <|im_start|>
    end: int  # <|im_end|>
    assistant: tuple[int, ...]  # the role ids that follow `start` in an assistant turn
    # tokenizer.json's directory: a differing turn is decoded to text to classify it
    tokenizer: str = field(default=str(DEFAULT_TOKENIZER), compare=False)

    def decode(self, ids: np.ndarray) -> str:
        return _decoder(self.tokenizer).decode(ids.tolist())

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def load(tokenizer_dir: str | os.PathLike = DEFAULT_TOKENIZER) -> TurnMarkers:

        path = Path(tokenizer_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no tokenizer.json (pass --tokenizer DIR)")
        # Plain JSON is ~10x faster to load than building the Rust tokenizer, and three ids is all
        # reconstruction needs. The role is looked up as a whole vocabulary entry first (true for
        # Qwen's BPE); otherwise the real tokenizer encodes it.
        spec = json.loads(path.read_text(encoding="utf-8"))
        added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
        start, end = added.get("<|im_start|>"), added.get("<|im_end|>")
        if start is None or end is None:
            raise ValueError(f"{path}: tokenizer has no <|im_start|>/<|im_end|> tokens (not a ChatML model)")
        vocab = (spec.get("model") or {}).get("vocab") or {}
        if isinstance(vocab, dict) and "assistant" in vocab:
            role: tuple[int, ...] = (int(vocab["assistant"]),)
        else:
            from tokenizers import Tokenizer

            role = tuple(Tokenizer.from_file(str(path)).encode("assistant", add_special_tokens=False).ids)
        return TurnMarkers(int(start), int(end), role, str(tokenizer_dir))


@functools.lru_cache(maxsize=4)
def _decoder(tokenizer_dir: str):
    table = bytedecode.load(tokenizer_dir)  # byte-level BPE (Qwen): a table lookup, no Rust tokenizer
    if table is not None:
        return table
    from tokenizers import Tokenizer

    rust = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return _RustDecoder(rust)


class _RustDecoder:
    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids) -> str:
        # The Rust decoder skips an id it does not know; a turn that differs only by such an id would
        # then read as "the same text" (a bpe-merge REALIGN). Refuse it, as bytedecode does.
        bad = [i for i in ids if self.tok.id_to_token(i) is None]
        if bad:
            raise ValueError(f"token ids not in the tokenizer's vocabulary: {bad[:5]}")
        return self.tok.decode(ids, skip_special_tokens=False)
