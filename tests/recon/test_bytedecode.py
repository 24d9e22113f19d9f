"""polar_recon/bytedecode.py against the real Qwen3 tokenizer (the Rust `tokenizers` decode with
skip_special_tokens=False, what reconstruction used before): every vocabulary entry alone, random id
runs (cut UTF-8 sequences included), and real text round-trips."""
from __future__ import annotations

import random
import unicodedata

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from polar_contracts.assets import QWEN3_TOKENIZER
from polar_recon import bytedecode


@pytest.fixture(scope="module")
def pair():
    rust = Tokenizer.from_file(str(QWEN3_TOKENIZER / "tokenizer.json"))
    ours = bytedecode.load(str(QWEN3_TOKENIZER))
    assert ours is not None, "the Qwen3 tokenizer is byte-level BPE: the table decoder must load"
    return rust, ours


def test_every_token_alone(pair):
    rust, ours = pair
    n = rust.get_vocab_size(with_added_tokens=True)
    bad = [i for i in range(n) if ours.decode([i]) != rust.decode([i], skip_special_tokens=False)]
    assert not bad, f"{len(bad)} ids decode differently, e.g. {bad[:5]}"


def test_random_runs(pair):
    rust, ours = pair
    n = rust.get_vocab_size(with_added_tokens=True)
    rng = random.Random(0)
    for _ in range(3000):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 12))]
        assert ours.decode(ids) == rust.decode(ids, skip_special_tokens=False), ids


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=60))
@example("\U0002f800")  # NFC changes it (found by hypothesis in a run)
def test_text_round_trip_and_cuts(pair, text):
    rust, ours = pair
    ids = rust.encode(text, add_special_tokens=False).ids
    # Qwen's normalizer is NFC: encoding maps e.g. U+2F800 (a compatibility ideograph) to U+4E3D
    assert ours.decode(ids) == unicodedata.normalize("NFC", text) == rust.decode(ids, skip_special_tokens=False)
    for cut in range(len(ids)):  # prefixes end inside multi-byte characters: replaced alike
        assert ours.decode(ids[:cut]) == rust.decode(ids[:cut], skip_special_tokens=False)


def test_not_byte_level_is_none(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "WordPiece", "vocab": {"a": 0}}, "decoder": null}')
    assert bytedecode.load(str(tmp_path)) is None


def test_unknown_id_is_a_clear_error(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        ours.decode([10**7])
