"""The coverage ledger (polar_recon/ledger.py): sampled = trained + excluded by reason, per episode
(manifest `ledger`), per run (manifest `ledger_total`, the build's summary line), and an error
naming the episode when it does not close."""
import json

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from polar_contracts.log.arrays import read_calls
from polar_contracts.shards import MANIFEST
from polar_recon import build as build_mod
from polar_recon.build import Options, build
from polar_recon.cli import main
from polar_recon.ledger import Ledger, LedgerError, episode_ledger
from polar_recon.strategies import token_sequences
from polar_recon.tokens import TurnMarkers

from . import logs as L


def compacted(c):
    """Two turns, a flagged title call, a compaction (the history replaced by a summary), two more
    turns, and a call whose stream broke (its ids unknown: nothing sampled is recorded)."""
    L.auxiliary_call(c.w)
    L.two_tool_turns(c)
    c.compact("wrote hello.txt and checked it")
    c.user("Now append a line.")
    c.call(L.Sample("Append.", "", [L.write_tool(content="hi\nthere")]), results=["ok"])
    c.call(L.Sample("Done.", "Appended.", []))
    c.cut_off()


def sampled_of(path) -> int:
    return sum(len(c.completion) for c in read_calls(path).calls if c.completion is not None)


def test_ledger_closes_per_episode_and_per_run(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a", compacted, reward=1.0)
    L.episode(logdir, "b", L.two_tool_turns, reward=0.0, seed=3)
    r = CliRunner().invoke(main, ["build", str(logdir), str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    m = json.loads((out / MANIFEST).read_text())
    df = pl.concat([pl.read_parquet(p) for p in sorted(out.glob("shard-*.parquet"))])
    for eid in ("a", "b"):
        led = m["ledger"][eid]
        rows = df.filter(pl.col("episode_id") == eid)
        assert led["sampled"] == sampled_of(logdir / f"{eid}.arrow") > 0
        assert led["trained"] == sum(int(np.sum(x)) for x in rows["loss_mask"].to_list())
        assert led["trained"] + sum(led["excluded"].values()) == led["sampled"]
    aux = m["ledger"]["a"]["excluded"]
    assert aux["auxiliary"] == len(L.encode('{"title": "Create hello file"}<|im_end|>'))
    assert aux["error"] == 0  # the broken call: counted as a call, no ids to count
    assert m["ledger"]["a"]["calls"] == 7
    assert "excluded" not in m["ledger"]["b"] or not any(m["ledger"]["b"]["excluded"].values())
    tot = m["ledger_total"]
    assert tot["sampled"] == m["ledger"]["a"]["sampled"] + m["ledger"]["b"]["sampled"]
    assert tot["episodes"] == 2 and tot["episodes_without_ledger"] == 0
    trained = 100 * tot["trained"] / tot["sampled"]
    assert f"ledger: {tot['sampled']:,} sampled tokens: 100.0% accounted for, {trained:.1f}% trained " \
           f"(excluded: auxiliary {aux['auxiliary']})" in r.output


def test_too_long_calls_count_their_tokens_under_their_reason(tmp_path):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    conv = L.episode(logdir, "e", L.two_tool_turns)
    last = conv.recorded[-1]
    # the last call alone is longer than the limit; the first two fit, in one row each or together
    limit = len(last.prompt_ids) + len(last.completion_ids) - 1
    rep = build(logdir, tmp_path / "out", Options(max_len=limit))
    assert not rep.errors
    led = rep.ledgers["e"]
    assert led.excluded == {"longer than max_len": len(last.completion_ids)}
    assert led.closes and led.sampled == sum(len(r.completion_ids) for r in conv.recorded)
    assert rep.ledger.trained == rep.trainable


def test_a_ledger_that_does_not_close_is_an_error_naming_the_episode(tmp_path, monkeypatch):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "fine", L.two_tool_turns, metadata={"group_id": "g1"})
    L.episode(logdir, "lossy", compacted, metadata={"group_id": "g2"})

    def forgetful(ep, m, *a, excluded=None, **kw):  # a strategy bug: loses the calls it leaves out
        return token_sequences(ep, m, *a, **kw)

    monkeypatch.setattr(build_mod, "token_sequences", forgetful)
    rep = build(logdir, out, Options())
    assert rep.built == ["fine"]
    [(path, msg)] = rep.errors
    assert path.endswith("lossy.arrow")
    assert "episode lossy: the coverage ledger does not close" in msg
    assert "neither trained nor excluded" in msg
    m = json.loads((out / MANIFEST).read_text())
    assert set(m["ledger"]) == {"fine"} and "lossy" not in m["episodes"]


def test_episode_ledger_refuses_double_counts_and_mask_mismatches(tmp_path):
    L.episode(tmp_path, "e", L.two_tool_turns)
    ep = read_calls(tmp_path / "e.arrow")
    m = TurnMarkers.load(str(L.TOKENIZER_DIR))
    excluded: list = []
    seqs = token_sequences(ep, m, excluded=excluded)
    led = episode_ledger(ep, seqs, excluded)
    assert led.closes and led.trained == led.sampled and led.excluded == {}
    with pytest.raises(LedgerError, match=r"episode e: .*counted twice: row 0 and excluded \(auxiliary\)"):
        episode_ledger(ep, seqs, [(ep.calls[0].row, "auxiliary")])
    seqs[0].loss_mask[: len(seqs[0].loss_mask) // 2] = 1  # a mask that trains context tokens
    with pytest.raises(LedgerError, match="row 0 trains .* tokens but its calls"):
        episode_ledger(ep, seqs, [])


def test_ledger_json_round_trip_and_bad_input():
    led = Ledger(10, 7, {"auxiliary": 3}, calls=4, episodes=1)
    assert Ledger.from_json(led.to_json()) == led
    assert led.summary() == "10 sampled tokens: 100.0% accounted for, 70.0% trained (excluded: auxiliary 3)"
    with pytest.raises(ValueError, match="manifest.json: ledger of x: not a ledger"):
        Ledger.from_json({"sampled": 1}, "manifest.json: ledger of x")
