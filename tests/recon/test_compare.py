"""`polar-recon compare` over real harness runs: pi, qwen-code and codex (the real CLIs) through
mitmdump + the Polar addon + scripted polar-serve, two episodes each, one store per harness
(tests/recon/compare_stores.py). Every number checked here is recomputed independently: shards read
with pyarrow directly, logs through polar_contracts.log.reader (full prompts, decompressed), rollout
records as JSON. The page is opened in headless Chromium (DevTools protocol): plots drawn, no
console errors; its screenshot is kept under the test's tmp dir (and $POLAR_ARTIFACTS when set).
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from polar_recon.cli import main
from polar_recon.compare.table import lines as table_lines
from tests.recon import logs as L
from tests.recon import png
from tests.recon.compare_stores import HARNESSES, build_stores
from tests.support.chromium import chromium, open_page

T95 = {1: 12.706, 2: 4.303, 3: 3.182}  # two-sided 95% Student t by degrees of freedom


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    return build_stores(tmp_path_factory.mktemp("experiment"))


def _wilson(k: int, n: int) -> list[float]:
    """The 95% Wilson score interval, written out independently of polar_recon/compare/stats.py."""
    z = 1.96
    centre = (k + z * z / 2) / (n + z * z)
    half = z * math.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def _compare(*args) -> dict:
    r = CliRunner().invoke(main, ["compare", *map(str, args), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _shard_truth(store: Path) -> dict:
    """Per episode from the shard files alone (pyarrow): reward, tokens, trainable, rows, realign."""
    t = pa.concat_tables(pq.read_table(p) for p in sorted(store.glob("shard-*.parquet")))
    tokens = pc.list_value_length(t["input_ids"]).to_numpy()
    trainable = np.array([int(np.sum(m)) for m in t["loss_mask"].to_numpy(zero_copy_only=False)])
    out: dict[str, dict] = {}
    for k, eid in enumerate(t["episode_id"].to_pylist()):
        e = out.setdefault(eid, {"reward": t["reward"][k].as_py(), "tokens": 0, "trainable": 0, "rows": 0,
                                 "realign": 0, "classes": [], "terminations": []})
        e["tokens"] += int(tokens[k])
        e["trainable"] += int(trainable[k])
        e["rows"] += 1
        e["realign"] += t["realign_tokens"][k].as_py() or 0
        e["classes"] += [(c, t["realign_tokens"][k].as_py()) for c in (t["realign_classes"][k].as_py() or [])]
        e["terminations"].append((t["segment"][k].as_py(), t["termination"][k].as_py()))
    return out


def test_report_numbers_match_the_shards_logs_and_records(stores):
    from polar_contracts.log.reader import read_episode

    rep = _compare(stores)
    assert sorted(rep["harnesses"]) == sorted(HARNESSES)
    for h in HARNESSES:
        got, store = rep["harnesses"][h], stores / h
        truth = _shard_truth(store)
        assert got["episodes"]["built"] == len(truth) == 2
        recs = [json.loads(x) for x in (store / "rollout" / "episodes.jsonl").read_text().splitlines()]
        assert got["episodes"]["recorded"] == len(recs)
        assert got["episodes"]["by_status"] == {"done": 2}
        # reward and its interval (a 0/1 reward: Wilson; else Student t at n-1 degrees of freedom,
        # within the rewards' range), solve rate
        rewards = np.array([e["reward"] for e in truth.values()])
        assert got["reward"]["mean"] == pytest.approx(rewards.mean())
        if set(rewards.tolist()) <= {0.0, 1.0}:
            assert got["reward"]["ci95"] == pytest.approx(_wilson(int(rewards.sum()), len(rewards)))
        else:
            half = T95[len(rewards) - 1] * rewards.std(ddof=1) / math.sqrt(len(rewards))
            assert got["reward"]["ci95"] == pytest.approx([max(rewards.min(), rewards.mean() - half),
                                                           min(rewards.max(), rewards.mean() + half)])
        assert got["reward"]["solve_rate"] == pytest.approx(float((rewards >= 1.0).mean()))
        # tokens: rows of the shards, the trainable share, the longest episode named
        tok = {e: v["tokens"] for e, v in truth.items()}
        tr = sum(v["trainable"] for v in truth.values())
        assert got["rows"]["tokens"] == sum(tok.values()) and got["rows"]["trainable"] == tr
        assert got["rows"]["trainable_share"] == pytest.approx(tr / sum(tok.values()))
        assert got["rows"]["tokens_per_episode"]["max"] == max(tok.values())
        assert tok[got["rows"]["tokens_per_episode"]["max_episode"]] == max(tok.values())
        # context fidelity from the fidelity columns
        ctx = sum(v["tokens"] - v["trainable"] for v in truth.values())
        realign = sum(v["realign"] for v in truth.values())
        f = got["fidelity"]
        assert f["context_tokens"] == ctx and f["realign_tokens"] == realign
        assert f["realign_share"] == pytest.approx(realign / ctx)
        classes: dict[str, int] = {}
        for v in truth.values():
            for c, n in v["classes"]:
                classes[c] = classes.get(c, 0) + (n or 0)
        assert {c: v["tokens"] for c, v in f["classes"].items()} == classes
        assert f["chain_breaks"] == sum(v["rows"] - 1 for v in truth.values())
        if realign:
            worst = max(truth, key=lambda e: truth[e]["realign"])
            assert f["worst_rerender"] == {"episode": worst, "tokens": truth[worst]["realign"]}
        last = {}
        for e, v in truth.items():
            last[e] = max(v["terminations"])[1]
        assert got["terminations"]["episodes"] == {k: list(last.values()).count(k) for k in set(last.values())}
        # calls and tokens per episode from the logs (full prompts, decompressed by the reader)
        calls, prompt, completion = {}, {}, {}
        for e in truth:
            c = read_episode(store / "logs" / f"{e}.arrow").calls
            calls[e] = c.height
            prompt[e] = sum(len(x) for x in c["prompt_ids"].to_list() if x is not None)
            completion[e] = sum(len(x) for x in c["completion_ids"].to_list() if x is not None)
        assert got["calls"]["source"] == "logs"
        assert got["calls"]["calls_per_episode"]["mean"] == pytest.approx(np.mean(list(calls.values())))
        assert got["calls"]["prompt_tokens_per_episode"]["mean"] == pytest.approx(np.mean(list(prompt.values())))
        assert got["calls"]["prompt_tokens_per_episode"]["max"] == max(prompt.values())
        assert got["calls"]["completion_tokens_per_episode"]["mean"] == pytest.approx(np.mean(list(completion.values())))
        assert 0 < got["calls"]["model_share_of_agent"] < 1
        # phase times from the rollout records
        for phase, key in (("prewarm", "prewarm"), ("agent", "run"), ("eval", "eval"), ("recon", "recon")):
            secs = [r["phases"][key][1] - r["phases"][key][0] for r in recs]
            assert got["phases_s"][phase]["mean"] == pytest.approx(np.mean(secs))
            assert got["phases_s"][phase]["max"] == pytest.approx(max(secs))
        # per weight version: every episode counted once
        assert sum(v["episodes"] for v in got["by_weight_version"]) == len(truth)
    # the harnesses differ where the paper says they do: where their tokens go
    shares = {h: rep["harnesses"][h]["rows"]["trainable_share"] for h in HARNESSES}
    assert len({round(s, 4) for s in shares.values()}) == len(HARNESSES), shares


def test_terminal_table_names_every_harness(stores):
    r = CliRunner().invoke(main, ["compare", str(stores)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    for h in HARNESSES:
        assert h in r.output
    for label in ("reward mean [95% CI]", "trainable-token share", "re-rendered context tokens", "agent s / episode"):
        assert label in r.output


def _trainer_state(path: Path, steps: int = 4) -> Path:
    """A TRL trainer_state.json as polar-train writes it (log_history keys of trainer/grpo_trainer.py)."""
    hist = [{"step": s, "epoch": s / steps, "reward": 0.25 * s, "reward_std": 0.1, "kl": 0.01 * s, "loss": 0.5 - 0.1 * s,
             "sampling/importance_sampling_ratio/mean": 1.0 + 0.01 * s,
             "sampling/importance_sampling_ratio/masked_frac": 0.02 * s, "polar/excluded_share": 0.0,
             "polar/policy_lag": float(s % 2)} for s in range(1, steps + 1)]
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": steps, "log_history": hist}))
    return path


def test_html_renders_in_headless_chromium_with_links_to_token_views(stores, tmp_path):
    exe = chromium()
    if exe is None:
        pytest.skip("chromium not installed (apt-get install -y chromium); the page test needs it")
    page = tmp_path / "report.html"
    trainer = _trainer_state(tmp_path / "ckpt-pi")
    r = CliRunner().invoke(main, ["compare", str(stores), "--html", str(page), "--trainer", f"pi={trainer}"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "<script src=" not in text and "cdn" not in text.lower().split("</head>")[0].split("<script")[0]
    # the token views the page links are written beside it and open the episode
    views = tmp_path / "report_episodes"
    linked = [p for p in views.rglob("*.html")]
    assert linked, "no token views written"
    for p in linked:
        assert f"href='report_episodes/{p.relative_to(views).as_posix()}'" in text
        assert "<h1>Episode " in p.read_text()
    res = open_page(page, "JSON.stringify({plots: document.querySelectorAll('.js-plotly-plot').length,"
                          " drawn: Array.from(document.querySelectorAll('.js-plotly-plot')).filter("
                          "d => d.querySelector('.main-svg') && d.data && d.data.length > 0).length,"
                          " titles: Array.from(document.querySelectorAll('.gtitle')).map(t => t.textContent)})",
                    height=1600)
    shot = tmp_path / "compare-report.png"
    shot.write_bytes(res.screenshot)
    if os.environ.get("POLAR_ARTIFACTS"):
        shutil.copy(shot, Path(os.environ["POLAR_ARTIFACTS"]) / shot.name)
    assert res.errors == [], res.errors
    info = json.loads(res.value)
    # six report figures + the training curves + the distributions over steps, each drawn
    assert info["plots"] == info["drawn"] == 8, info
    assert any("Training curves" in t for t in info["titles"]), info["titles"]
    img = png.decode(res.screenshot)[..., :3].astype(int)
    assert img.shape[:2] == (1600, 1400)
    assert (img.std(axis=(0, 1)) > 5).all(), "a blank page"
    blue = (img[..., 2] > 140) & (img[..., 0] < 110) & (img[..., 1] > 100) & (img[..., 1] < 150)
    assert blue.sum() > 2000, "the reward bars are not drawn"


def test_trainer_curves_in_json(stores, tmp_path):
    trainer = _trainer_state(tmp_path / "ckpt")
    rep = _compare(stores, "--trainer", f"codex={trainer}")
    t = rep["trainers"]["codex"]
    assert t["curves"]["reward"] == [[float(s), 0.25 * s] for s in range(1, 5)]
    assert t["summary"]["steps"] == 4 and t["summary"]["last"]["reward"] == 1.0
    d = t["summary"]["distributions"]["sampling/importance_sampling_ratio/masked_frac"]
    assert d["min"] == pytest.approx(0.02) and d["max"] == pytest.approx(0.08)
    # several harnesses: an unnamed trainer log is refused with the names to choose from
    r = CliRunner().invoke(main, ["compare", str(stores), "--trainer", str(trainer)])
    assert r.exit_code != 0 and "name the one it trained" in r.output and "qwen-code" in r.output


def _synthetic(tmp_path: Path) -> tuple[Path, Path]:
    """Logs with what real runs here rarely show: a discarded episode, an unfinished one, two rewards."""
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir(parents=True)
    meta = {"harness": "synth", "group_id": "g"}
    L.episode(logdir, "ok-1", L.two_tool_turns, reward=1.0, metadata=meta)
    def with_title_call(c):  # Claude Code's title call between agent calls: logged, never trained
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        L.auxiliary_call(c.w)
        c.call(L.Sample("Done.", "hello.txt contains hi.", []))
    # policy version 2: one tampered verdict (kept, reward 0), one eval error (discarded)
    L.episode(logdir, "ok-2", with_title_call, reward=0.0, weight_version="2",
              metadata={**meta, "eval": {"verdict": "tampered", "tampered": True}})
    L.episode(logdir, "bad-1", L.two_tool_turns, reward=0.0, weight_version="2",
              metadata={**meta, "discard": True, "status": "eval_error", "reason": "no test output"})
    L.episode(logdir, "running-1", L.two_tool_turns, end=False)
    r = CliRunner().invoke(main, ["build", str(logdir), str(out), "--group-by", "episode"])
    assert r.exit_code == 0, r.output
    return logdir, out


def test_exclusions_and_bare_logdirs(tmp_path):
    logdir, out = _synthetic(tmp_path)
    rep = _compare(f"synth={out}", "--logdir", logdir)
    h = rep["harnesses"]["synth"]
    man = json.loads((out / ".polar-recon-manifest.json").read_text())
    assert set(man["excluded"]) == {"bad-1"}
    assert h["episodes"]["built"] == 2 and h["episodes"]["excluded"] == {"discard: eval_error": 1}
    assert h["episodes"]["refs"]["excluded"] == {"discard: eval_error": ["bad-1"]}
    assert h["reward"]["mean"] == 0.5 and h["reward"]["solve_rate"] == 0.5
    assert h["reward"]["refs"]["unsolved"] == ["ok-2"]
    # samples not trained: the manifest's excluded calls, by reason, with their episodes
    want: dict[str, int] = {}
    for calls in man["excluded_calls"].values():
        for c in calls:
            want[c["reason"]] = want.get(c["reason"], 0) + 1
    assert want and h["not_trained"]["samples"] == want
    assert all(ids == ["ok-2"] for ids in h["not_trained"]["refs"].values())
    assert h["calls"]["auxiliary_calls"] == 1
    # how episodes were graded, per policy version (built and discarded alike): manifest and report
    v1 = {"episodes": 1, "discarded": 0, "eval_error": 0, "tampered": 0, "unreadable": 0, "timed_out": 0,
          "unchecked": 0}
    v2 = {**v1, "episodes": 2, "discarded": 1, "eval_error": 1, "tampered": 1}
    assert {v: {k: c[k] for k in v1} for v, c in man["verdict_counts"].items()} == {"1": v1, "2": v2}
    assert man["verdict_counts"]["2"]["rates"]["tampered"] == 0.5 and man["verdicts"]["ok-2"]["tampered"] is True
    assert man["verdicts"]["bad-1"] == {"policy": "2", "verdict": None, "tampered": False, "discarded": True,
                                        "status": "eval_error"}
    assert h["verdicts_by_version"] == man["verdict_counts"]
    table = CliRunner().invoke(main, ["compare", f"synth={out}", "--logdir", str(logdir)], catch_exceptions=False)
    assert "2: 50.0% / 50.0% / 50.0% of 2" in table.output.replace("\n", " "), table.output
    # the coverage ledger: the manifest's per-episode ledgers summed, every sampled token accounted for
    led = h["ledger"]
    assert led["episodes"] == 2 and led["closes"] and led["accounted_share"] == 1.0
    assert led["sampled"] == sum(e["sampled"] for e in man["ledger"].values()) > led["trained"] > 0
    assert led["excluded"] == {"auxiliary": man["ledger"]["ok-2"]["excluded"]["auxiliary"]}
    assert led["trained"] == h["rows"]["trainable"]
    assert dict(table_lines(h, None))["sampled tokens accounted for (ledger)"] == \
        f"100.0% of {led['sampled']:,}, {100 * led['trained_share']:.1f}% trained"
    # a bare log directory: grouped by the end metadata's harness; the unfinished log counts calls only
    rep = _compare(logdir)
    assert list(rep["harnesses"]) == ["synth"]
    assert rep["harnesses"]["synth"]["episodes"]["logs"] == 3
    assert rep["harnesses"]["synth"]["calls"]["calls_per_episode"]["n"] == 4


def test_bad_inputs_are_named(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(main, ["compare", str(empty)])
    assert r.exit_code != 0 and "not a store, rollout output, log directory or experiment root" in r.output
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "shard-000000.parquet").write_bytes(b"not parquet")
    r = CliRunner().invoke(main, ["compare", str(bad)])
    assert r.exit_code != 0 and "shard-000000.parquet: not a readable Parquet shard" in r.output
    pq.write_table(pa.table({"x": [1]}), bad / "shard-000000.parquet")
    r = CliRunner().invoke(main, ["compare", str(bad)])
    assert r.exit_code != 0 and "not a Polar shard (no episode_id, input_ids, loss_mask, reward column)" in r.output
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.host").write_bytes(b"")
    _, out = _synthetic(tmp_path / "s")
    r = CliRunner().invoke(main, ["compare", str(out), "--trainer", str(tb)])
    assert r.exit_code != 0 and "TensorBoard event files" in r.output and "trainer_state.json" in r.output
    r = CliRunner().invoke(main, ["compare", "s3://bucket/run/pi"])
    assert r.exit_code != 0 and "only local stores are read (s3:// is not" in r.output
    assert _compare(f"synth={out.as_uri()}")["harnesses"]["synth"]["episodes"]["built"] == 2  # a file:// store URI


def test_drift_per_harness_matches_polar_recon_drift(stores):
    rep = _compare(stores, "--drift")
    for h in HARNESSES:
        r = CliRunner().invoke(main, ["drift", str(stores / h / "logs"), "--json"], catch_exceptions=False)
        assert r.exit_code == 0, r.output
        want = json.loads(r.stdout)
        got = rep["harnesses"][h]["drift"]
        for k in ("episodes", "trainable_tokens", "retokenize_differing_tokens", "retokenize_sequences_affected",
                  "per_call_tokens", "token_sequence_tokens"):
            assert got[k] == want[k], (h, k)


def test_bench_synthesizes_a_store_the_report_reads(tmp_path):
    import subprocess
    import sys

    _, out = _synthetic(tmp_path / "src")
    keep = tmp_path / "bench"
    r = subprocess.run([sys.executable, str(L.REPO / "bench" / "bench_compare.py"), "--from", f"synth={out}",
                        "--episodes", "40", "--repeat", "1", "--json", "--keep", str(keep)],
                       capture_output=True, text=True, timeout=300, cwd=L.REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["episodes"] == 40 and res["rows"] == 40 and res["floor_s"] > 0 and res["report_over_floor"] > 0
    rep = _compare(keep / "experiment")
    h = rep["harnesses"]["synth"]
    assert h["episodes"]["built"] == h["episodes"]["recorded"] == 40
    t = pa.concat_tables(pq.read_table(p) for p in sorted((keep / "experiment" / "synth" / "shards").glob("*.parquet")))
    assert h["reward"]["mean"] == pytest.approx(float(np.mean(t["reward"].to_numpy())))
    assert sum(v["episodes"] for v in h["by_weight_version"]) == 40 and len(h["by_weight_version"]) > 1


def test_rollout_records_last_line_wins_and_a_torn_tail_is_ignored(tmp_path):
    _, out = _synthetic(tmp_path)
    (out / "rollout").mkdir()
    recs = [{"episode_id": "ok-1", "harness": "synth", "status": "error", "reward": 0.0},
            {"episode_id": "ok-1", "harness": "synth", "status": "done", "reward": 1.0,
             "phases": {"run": [10.0, 12.5], "eval": [12.5, 13.0]}},
            {"episode_id": "ok-2", "harness": "synth", "status": "done", "reward": 0.0,
             "phases": {"run": [10.0, 11.5], "eval": [11.5, 13.0]}}]
    (out / "rollout" / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"episode_id": "to')
    h = _compare(out)["harnesses"]["synth"]
    assert h["episodes"]["recorded"] == 2 and h["episodes"]["by_status"] == {"done": 2}
    assert h["phases_s"]["agent"]["mean"] == pytest.approx(2.0) and h["phases_s"]["agent"]["max_episode"] == "ok-1"
    assert h["phases_s"]["eval"]["max"] == pytest.approx(1.5) and h["phases_s"]["prewarm"] is None
