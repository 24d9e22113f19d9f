"""Decoding token ids to text from tokenizer.json alone, for byte-level BPE tokenizers (Qwen, GPT-2
family), without building the Rust tokenizer.

Reconstruction decodes only the assistant turns it has to classify (link.py, rerender.py). Building
the Rust tokenizer for that cost ~0.4-1 s and ~130 MiB per process (docs/benchmarks/recon.md); a
byte-level BPE decodes by table lookup: each vocabulary entry is its bytes spelled with GPT-2's
byte-to-unicode alphabet, each added token is its content verbatim. Text is the UTF-8 decoding of the
joined bytes with invalid sequences replaced, as the Rust ByteLevel decoder does
(String::from_utf8_lossy); tests/recon/test_bytedecode.py holds it to the real tokenizer.
`load` returns None for any other tokenizer kind: callers then use the Rust tokenizer.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path


def _byte_alphabet() -> dict[int, int]:
    """GPT-2's bytes_to_unicode, inverted as a str.translate table: the code point of the printable
    character that stands for each byte -> the byte's value (then .encode("latin-1") gives bytes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {c: b for b, c in chars.items()}


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    if decoder.get("type") == "Sequence":
        kinds = [d.get("type") for d in decoder.get("decoders", [])]
        return kinds == ["ByteLevel"]
    return False


class ByteDecoder:
    def __init__(self, table: list[bytes | None]):
        self.table = table

    def decode(self, ids) -> str:
        table = self.table
        try:
            return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
        except (IndexError, TypeError):
            bad = [i for i in ids if not (0 <= i < len(table)) or table[i] is None]
            raise ValueError(f"token ids not in the tokenizer's vocabulary: {bad[:5]}") from None


@functools.lru_cache(maxsize=4)
def load(tokenizer_dir: str | os.PathLike) -> ByteDecoder | None:
    return from_spec(json.loads((Path(tokenizer_dir) / "tokenizer.json").read_text(encoding="utf-8")))


def from_spec(spec: dict) -> ByteDecoder | None:
    """The decoder for a parsed tokenizer.json, or None when it is not byte-level BPE."""
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    # (a normalizer, e.g. Qwen's NFC, acts on encoding only)
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not _is_byte_level(spec.get("decoder")):
        return None
    alphabet = _byte_alphabet()
    added = {int(t["id"]): t["content"].encode("utf-8") for t in spec.get("added_tokens", [])}
    size = max([*vocab.values(), *added, -1]) + 1
    table: list[bytes | None] = [None] * size
    try:
        for piece, i in vocab.items():
            table[i] = piece.translate(alphabet).encode("latin-1")
    except UnicodeEncodeError:  # a piece outside the byte alphabet: not a byte-level vocabulary after all
        return None
    for i, content in added.items():
        table[i] = content
    return ByteDecoder(table)
