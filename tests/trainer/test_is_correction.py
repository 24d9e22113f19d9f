"""Importance sampling against behaviour logprobs: hand-computed ratios and clips for every mode."""
from __future__ import annotations

import math

import pytest
import torch

from trainer.is_correction import MODES, is_ratio, is_ratio_lost

# Two sequences, four completion positions. Row 0: log-diffs ln2, -ln4, 0(masked tool token), pad.
# Row 1: ln5, ln5 then padding. old - behaviour per token:
OLD = torch.tensor([[math.log(2.0), math.log(0.25), 5.0, 0.0],
                    [math.log(5.0), math.log(5.0), 0.0, 0.0]])
BEH = torch.zeros(2, 4)
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]])


def close(t, expected):
    assert torch.allclose(t, torch.tensor(expected, dtype=t.dtype), atol=1e-5), (t, expected)


def test_token_truncate():
    r, st = is_ratio(OLD, BEH, MASK, "token_truncate", 0.5, 3.0)
    close(r, [[2.0, 0.5, 1.0, 1.0], [3.0, 3.0, 1.0, 1.0]])  # masked positions: no correction
    assert st["clipped_frac"] == pytest.approx(3 / 4)  # 0.25 < 0.5, 5 > 3 twice
    assert (st["min"], st["max"]) == (pytest.approx(0.5), pytest.approx(3.0))
    assert st["mean"] == pytest.approx((2 + 0.5 + 3 + 3) / 4)
    assert st["raw_mean"] == pytest.approx((2 + 0.25 + 5 + 5) / 4)


def test_token_mask():
    r, st = is_ratio(OLD, BEH, MASK, "token_mask", 0.5, 3.0)
    close(r, [[2.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    assert st["clipped_frac"] == pytest.approx(3 / 4)
    assert st["max"] == pytest.approx(2.0) and st["min"] == 0.0


def test_sequence_truncate():
    # Row 0: exp(ln2 - ln4) = 0.5 ; row 1: exp(2 ln5) = 25 -> 3.
    r, st = is_ratio(OLD, BEH, MASK, "sequence_truncate", None, 3.0)
    close(r, [[0.5], [3.0]])
    assert st["clipped_frac"] == pytest.approx(0.5)
    assert st["raw_mean"] == pytest.approx((0.5 + 25) / 2)


def test_sequence_mask():
    r, st = is_ratio(OLD, BEH, MASK, "sequence_mask", 0.6, 3.0)
    close(r, [[0.0], [0.0]])  # 0.5 < 0.6 and 25 > 3: both masked
    assert st["clipped_frac"] == 1.0
    assert st["logp_diff_max"] == pytest.approx(math.log(5.0))  # per token, masked positions excluded
    r, _ = is_ratio(OLD, BEH, MASK, "sequence_mask", None, 30.0)
    close(r, [[0.5], [25.0]])


def test_nan_and_zero_mask_rows():
    old = torch.tensor([[float("nan"), 0.3], [0.0, 0.0], [0.1, 0.2]])
    beh = torch.zeros(3, 2)
    mask = torch.tensor([[1, 1], [0, 0], [1, 1]])  # row 1: a padding row that trains nothing
    # sequence modes: a token that cannot be scored fails its whole sequence (as TRL's -inf sum and
    # slime's veto do), counted by reason with every trainable token of the row
    for mode in ("sequence_mask", "sequence_truncate"):
        r, st, lost = is_ratio_lost(old, beh, mask, mode, None, 3.0)
        close(r, [[0.0], [1.0], [math.exp(0.3)]])
        assert st["mean"] == pytest.approx(math.exp(0.3) / 2)  # the padding row is left out of the stats
        assert st["masked_frac"] == pytest.approx(1 / 2) and st["lost_token_share"] == pytest.approx(2 / 4)
        assert set(lost) == {"nonfinite_logprob"} and lost["nonfinite_logprob"].tolist() == [[True, True], [False] * 2,
                                                                                             [False] * 2]
    # token modes: the token alone
    r, st, lost = is_ratio_lost(old, beh, mask, "token_truncate", None, 3.0)
    close(r, [[0.0, math.exp(0.3)], [1.0, 1.0], [math.exp(0.1), math.exp(0.2)]])
    assert lost["nonfinite_logprob"].tolist() == [[True, False], [False] * 2, [False] * 2]
    assert st["lost_token_share"] == pytest.approx(1 / 4)


def test_lost_tokens_by_reason():
    """Every trainable token a *_mask mode zeroes is returned by reason (the trainer counts them)."""
    r, st, lost = is_ratio_lost(OLD, BEH, MASK, "token_mask", 0.5, 3.0)
    assert lost["is_ratio_high"].tolist() == [[False] * 4, [True, True, False, False]]
    assert lost["is_ratio_low"].tolist() == [[False, True, False, False], [False] * 4]
    assert st["lost_token_share"] == pytest.approx(3 / 4)
    r, st, lost = is_ratio_lost(OLD, BEH, MASK, "sequence_mask", 0.6, 3.0)
    assert lost["is_ratio_low"].tolist() == [[True, True, False, False], [False] * 4]  # trainable tokens only
    assert lost["is_ratio_high"].tolist() == [[False] * 4, [True, True, False, False]]
    _, st, lost = is_ratio_lost(OLD, BEH, MASK, "token_truncate", 0.5, 3.0)
    assert lost == {} and st["lost_token_share"] == 0.0  # truncation weighs, never drops
    # a sequence ratio far below 1 without clip_min: not lost, but shown as vanishing
    old = torch.tensor([[-5.0, -5.0, 0.0, 0.0], [0.1, 0.0, 0.0, 0.0]])
    _, st2, lost2 = is_ratio_lost(old, BEH, MASK, "sequence_truncate", None, 3.0)
    assert lost2 == {} and st2["vanishing_weight_share"] == pytest.approx(2 / 4)  # e^-10 on row 0's 2 tokens
    # the signed mean log ratio per token (finite trainable tokens): (ln2 - ln4 + 2 ln5) / 4
    assert st["logp_diff_signed_mean"] == pytest.approx((math.log(0.5) + 2 * math.log(5.0)) / 4)


def test_errors():
    with pytest.raises(ValueError, match="unknown importance sampling mode"):
        is_ratio(OLD, BEH, MASK, "tis", None, 3.0)
    with pytest.raises(ValueError, match="needs clip_min or clip_max"):
        is_ratio(OLD, BEH, MASK, "token_truncate", None, None)
    assert set(MODES) == {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}
