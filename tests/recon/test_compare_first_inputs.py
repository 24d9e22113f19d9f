"""`polar-recon compare` on what a first run leaves: a bare log directory, a build OUT without its
logs, a rollout OUT (its own logs in rollout/logs/); intervals and plots that cannot mislead."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from polar_recon.cli import main
from polar_recon.compare.page import _share_range, render
from polar_recon.compare.stats import mean_ci, wilson
from tests.recon import logs as L


def compare(*args) -> tuple[dict, str]:
    r = CliRunner().invoke(main, ["compare", *map(str, args), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    table = CliRunner().invoke(main, ["compare", *map(str, args)], catch_exceptions=False)
    return json.loads(r.stdout), table.output


def logs(tmp_path: Path) -> Path:
    d = tmp_path / "logs"
    d.mkdir()
    meta = {"harness": "synth", "group_id": "g"}
    L.episode(d, "ok-1", L.two_tool_turns, reward=1.0, metadata=meta)
    L.episode(d, "ok-2", L.two_tool_turns, reward=0.0, metadata=meta, seed=1)
    L.episode(d, "bad-1", L.two_tool_turns, reward=1.0, metadata={**meta, "discard": True, "status": "error"})
    return d


def build(logdir: Path, out: Path) -> None:
    r = CliRunner().invoke(main, ["build", str(logdir), str(out)])
    assert r.exit_code == 0, r.output


def test_a_bare_logdir_has_rewards_from_its_end_records(tmp_path):
    rep, table = compare(logs(tmp_path))
    rw = rep["harnesses"]["synth"]["reward"]
    assert rw["source"] == "end records" and rw["n"] == 2 and rw["mean"] == 0.5  # the discarded one left out
    assert rw["ci95"] == pytest.approx(wilson(1, 2)) and rw["solve_rate"] == 0.5
    assert "0.500 [" in table and "(end records)" in table


def test_a_build_out_without_logs_says_where_they_would_come_from(tmp_path):
    d = logs(tmp_path)
    build(d, tmp_path / "out")
    rep, table = compare(tmp_path / "out")
    (h,) = rep["harnesses"].values()  # (named after the directory: no records name it)
    assert h["calls"]["source"] == "shards"
    assert "no capture logs read: --logdir LOGDIR" in table
    rep, table = compare(tmp_path / "out", "--logdir", d)
    (h,) = rep["harnesses"].values()
    assert h["calls"]["prompt_tokens_per_episode"]["n"] == 3  # the discarded one's calls were made too
    assert "no capture logs read" not in table


def test_a_rollout_out_reads_its_own_logs(tmp_path):
    """polar-rollout run links each episode's log into OUT/rollout/logs (harness_recipes/node/records.py)."""
    d = logs(tmp_path)
    out = tmp_path / "out"
    own = out / "rollout" / "logs"
    own.mkdir(parents=True)
    for p in d.glob("ok-*.arrow"):
        (own / p.name).hardlink_to(p)
    build(own, out)
    rep, _ = compare(out)
    (h,) = rep["harnesses"].values()
    c = h["calls"]
    assert c["source"] == "logs" and c["call_ms"] is not None and c["prompt_tokens_per_episode"]["n"] == 2


def test_reward_intervals_stay_in_the_rewards_range():
    r = mean_ci(pl.Series([0.0, 1.0]))  # a t interval would be 0.5 [-5.853, 6.853]
    assert r["ci_method"] == "wilson" and 0.0 <= r["ci95"][0] < 0.5 < r["ci95"][1] <= 1.0
    r = mean_ci(pl.Series([0.2, 0.9]))
    assert r["ci_method"] == "t, clipped" and r["ci95"] == [0.2, 0.9]
    r = mean_ci(pl.Series([0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8] * 5))
    assert 0.2 < r["ci95"][0] < r["mean"] < r["ci95"][1] < 0.8  # a wide sample: the plain t interval
    assert mean_ci(pl.Series([1.0]))["ci95"] is None


def test_empty_plots_say_no_data_and_tiny_shares_stay_small(tmp_path):
    rep, _ = compare(logs(tmp_path))  # no shards, no rollout records
    page = render(rep, {})
    for why in ("no data: no shard rows", "no data: no rollout records"):
        assert why in page, why
    assert "no data: no episode has a reward" not in page  # the end records' rewards are drawn
    assert _share_range([0.0007]) == [0, 0.05] and _share_range([0.5])[1] == pytest.approx(0.6)
