"""`polar-recon build` and friends on a directory of real (Qwen3-template) episode logs."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from polar_contracts.log.writer import EpisodeWriter
from polar_contracts.shards import MANIFEST, SHARD_SCHEMA
from polar_recon.build import Options, build, watch
from polar_recon.cli import main

from . import logs as L

REPO = Path(__file__).resolve().parents[2]


def simple(c):
    L.two_tool_turns(c, reasoning=("Write it.", "Check it."))


def whitespace(c):
    L.two_tool_turns(c, reasoning=("", ""))


def make_logdir(d: Path) -> dict:
    """Two groups of two, plus every kind of episode that must not be built."""
    convs = {}
    for g, task in enumerate(["t1", "t2"]):
        for k in range(2):
            eid = f"ep-{task}-{k}"
            convs[eid] = L.episode(d, eid, simple if k == 0 else whitespace, reward=float(g + k),
                                   metadata={"task_id": task, "harness": "tidy" if k == 0 else "qwen-code"},
                                   harness="tidy" if k == 0 else "qwen-code", seed=g * 10 + k)
    L.episode(d, "no-reward", simple, reward=None, metadata={"task_id": "t1"}, harness="tidy")
    # ended by the rollout after Ctrl-C (harness_recipes/node/scheduler.py _metadata): a reward, a group,
    # complete calls - and still no training signal
    L.episode(d, "discarded", simple, reward=0.0, harness="tidy",
              metadata={"task_id": "t1", "group_id": "t1", "status": "interrupted", "discard": True})

    def cut(c):
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        c.cut_off()
    L.episode(d, "cut-off", cut, end=False, harness="tidy")
    (d / "corrupt.arrow").write_bytes(b"this is not an arrow stream at all")
    # a proxy killed mid-write: a torn batch at the end of an unfinished log
    L.episode(d, "torn", simple, end=False, harness="tidy")
    with open(d / "torn.arrow", "ab") as f:
        f.write(b"\xff\xff\xff\xff\x10\x01\x00\x00garbage")
    return convs


def run(*args):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return r.exit_code, r.output


def read_shards(out: Path) -> pl.DataFrame:
    return pl.concat([pl.read_parquet(p) for p in sorted(out.glob("shard-*.parquet"))])


def test_build_reports_bad_logs_and_builds_the_rest(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    convs = make_logdir(logdir)
    code, text = run("build", logdir, out, "--group-by", "task_id")
    assert code == 1  # an error was reported...
    assert "corrupt.arrow" in text and "not an Arrow IPC stream" in text
    assert "no reward (1): no-reward" in text
    assert "discarded by the rollout (metadata.discard) (1): discarded" in text
    assert "cut-off" in text and "torn" in text and "not finished" in text
    df = read_shards(out)  # ...and everything else was built
    assert sorted(df["episode_id"].unique().to_list()) == sorted(convs)
    assert df.schema == pl.from_arrow(SHARD_SCHEMA.empty_table()).schema
    assert set(df["group_id"]) == {"t1", "t2"} and set(df["group_size"]) == {2} and df["group_complete"].all()
    assert dict(zip(df["episode_id"], df["reward"])) == {"ep-t1-0": 0.0, "ep-t1-1": 1.0, "ep-t2-0": 1.0, "ep-t2-1": 2.0}
    assert not list(out.glob(".*.tmp")) and (out / MANIFEST).exists()
    # rows are faithful: trainable ids are the sampled ones
    for row in df.iter_rows(named=True):
        ids, mask, lps = (np.asarray(row[c]) for c in ("input_ids", "loss_mask", "logprobs"))
        rec = convs[row["episode_id"]].recorded
        assert ids[mask == 1].tolist() == sum((r.completion_ids for r in rec), [])
        assert np.allclose(lps[mask == 1], sum((r.logprobs for r in rec), []))
        assert row["prompt_len"] == len(rec[0].prompt_ids) and row["n_calls"] == 3 and row["strategy"] == "token"
        assert row["weight_version"] == "1" and row["model"] == "qwen3-test"
    assert dict(zip(df["episode_id"], df["n_realign"]))["ep-t1-1"] == 2


def test_shards_load_with_datasets(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a", simple, harness="tidy")
    assert run("build", logdir, out)[0] == 0
    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=[str(p) for p in out.glob("shard-*.parquet")], split="train",
                      cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == 1 and ds[0]["episode_id"] == "a" and len(ds[0]["input_ids"]) == len(ds[0]["loss_mask"])


def test_build_is_idempotent_and_adds_only_new_episodes(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a", simple, harness="tidy")
    L.episode(logdir, "b", whitespace, harness="qwen-code")
    assert run("build", logdir, out)[0] == 0
    shards = sorted(p.name for p in out.glob("shard-*.parquet"))
    code, text = run("build", logdir, out)
    assert code == 0 and "built 0 episodes (2 already built)" in text
    assert sorted(p.name for p in out.glob("shard-*.parquet")) == shards
    L.episode(logdir, "c", simple, harness="tidy")
    code, text = run("build", logdir, out)
    assert "built 1 episodes (2 already built)" in text
    new = sorted(set(p.name for p in out.glob("shard-*.parquet")) - set(shards))
    assert new == ["shard-000001.parquet"]
    assert pl.read_parquet(out / new[0])["episode_id"].to_list() == ["c"]
    # a crash after a shard's rename but before the manifest's save: nothing is built twice
    (out / MANIFEST).unlink()
    L.episode(logdir, "d", simple, harness="tidy")
    code, text = run("build", logdir, out)
    assert "built 1 episodes (3 already built)" in text
    assert read_shards(out)["episode_id"].sort().to_list() == ["a", "b", "c", "d"]
    # another strategy into the same OUT is refused
    code, text = run("build", logdir, out, "--strategy", "per-call")
    assert code != 0 and "strategy 'token'" in text


def test_a_failed_build_leaves_no_partial_shard(tmp_path, monkeypatch):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    for e in "abc":
        L.episode(logdir, e, simple, harness="tidy", metadata={"task_id": e})
    from polar_recon import build as B

    real = B.Builder.sequences

    def boom(self, path):
        if path.name == "c.arrow":
            raise OSError(5, "disk on fire")  # fatal: a per-episode bug is reported instead (below)
        return real(self, path)
    monkeypatch.setattr(B.Builder, "sequences", boom)
    with pytest.raises(OSError):
        build(logdir, out, Options(shard_size=2, group_by="task_id"))
    # the first shard (a, b) was complete and renamed; the one holding c never became visible
    assert [p.name for p in out.glob("shard-*")] == ["shard-000000.parquet"]
    assert not list(out.glob(".*tmp"))
    monkeypatch.setattr(B.Builder, "sequences", real)
    r = build(logdir, out, Options(shard_size=2, group_by="task_id"))
    assert r.built == ["c"] and r.already == 2


def test_rewards_file_and_group_size(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "x0", simple, reward=None, metadata={"task_id": "x"}, harness="tidy")
    L.episode(logdir, "x1", simple, reward=None, metadata={"task_id": "x"}, harness="tidy")
    L.episode(logdir, "y0", simple, reward=0.5, metadata={"task_id": "y"}, harness="tidy")
    rewards = tmp_path / "r.jsonl"
    rewards.write_text('{"episode_id": "x0", "reward": 1}\n{"episode_id": "y0", "reward": -1.5}\n')
    code, text = run("build", logdir, out, "--group-by", "task_id", "--group-size", "2", "--rewards", rewards)
    # x1 has no reward anywhere: excluded (never reward 0), so group x is short and waits
    assert "no reward (1): x1" in text and "group x: 1 episodes finished, waiting" in text
    assert "group y: 1 episodes finished, waiting" in text and "built 0 episodes" in text
    rewards.write_text(json.dumps({"x0": 1, "x1": 0.25, "y0": -1.5}))
    code, text = run("build", logdir, out, "--group-by", "task_id", "--group-size", "2", "--rewards", rewards)
    assert code == 0 and "built 2 episodes" in text and "group y" in text
    code, text = run("build", logdir, out, "--group-by", "task_id", "--group-size", "2", "--include-incomplete")
    df = read_shards(out)
    assert dict(zip(df["episode_id"], df["reward"])) == {"x0": 1.0, "x1": 0.25, "y0": 0.5}
    assert dict(zip(df["group_id"], df["group_complete"])) == {"x": True, "y": False}
    bad = tmp_path / "bad.json"
    bad.write_text('{"x0": "high"}')
    code, text = run("build", logdir, out, "--rewards", bad)
    assert code == 2 and "not a number" in text


def test_group_by_missing_key_is_reported(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a", simple, metadata={}, harness="tidy")
    code, text = run("build", logdir, out, "--group-by", "task_id")
    assert code == 1 and "a.arrow" in text and "no 'task_id'" in text


def test_per_call_and_retokenize_strategies(tmp_path):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    conv = L.episode(logdir, "a", whitespace, harness="qwen-code")
    assert run("build", logdir, tmp_path / "pc", "--strategy", "per-call")[0] == 0
    pc = read_shards(tmp_path / "pc")
    assert pc.height == 3 and pc["segment"].to_list() == [0, 1, 2] and set(pc["strategy"]) == {"per-call"}
    assert run("build", logdir, tmp_path / "rt", "--strategy", "retokenize")[0] == 0
    rt = read_shards(tmp_path / "rt")
    assert rt.height == 1
    ids, mask = np.asarray(rt["input_ids"][0]), np.asarray(rt["loss_mask"][0])
    sampled = sum((r.completion_ids for r in conv.recorded), [])
    assert ids[mask == 1].tolist() != sampled  # the text round trip lost the sampled ids


def test_inspect_stats_drift(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    make_logdir(logdir)
    run("build", logdir, out, "--group-by", "task_id")
    code, text = run("inspect", logdir / "ep-t1-1.arrow", "--json")
    rows = [json.loads(line) for line in text.splitlines()]
    assert [r["link"] for r in rows] == ["FORK", "REALIGN", "REALIGN"] and rows[1]["parent"] == 0
    assert rows[0]["ttfb_ms"] == 100.0 and rows[0]["api"] == "chat"
    code, text = run("inspect", "cut-off", "--logdir", logdir)
    assert code == 0 and "ERROR" in text and "NOT finished" in text
    code, text = run("inspect", "nope", "--logdir", logdir)
    assert code == 2 and "no log 'nope'" in text
    code, text = run("stats", out, "--json")
    s = json.loads(text)
    assert s["episodes"] == 4 and s["groups"] == 2 and s["segments"] == 4 and s["reward_max"] == 2.0
    assert s["trainable_tokens"] > 0 and s["realigned_turns"] == 4
    assert s["discarded"] == 1 and s["discarded_ids"] == ["discarded"]
    code, text = run("inspect", "discarded", "--logdir", logdir)
    assert code == 0 and "DISCARDED" in text and "'interrupted'" in text
    code, text = run("inspect", "ep-t1-0", "--logdir", logdir)
    assert code == 0 and "DISCARDED" not in text
    code, text = run("stats", out)
    assert "reward histogram" in text and "discarded          1" in text
    code, text = run("drift", logdir, "--json")
    d = json.loads(text.splitlines()[-1])
    assert d["episodes"] == 5  # the 4 + the one without reward; unfinished, discarded and corrupt skipped
    assert 0 < d["retokenize_differing_share"] < 1 and d["retokenize_sequences_affected"] == 2
    assert d["links_by_harness"]["qwen-code"]["REALIGN"] == 4 and d["links_by_harness"]["tidy"]["CLEAN"] == 4


def test_drift_is_zero_when_text_round_trips(tmp_path):
    logdir = tmp_path / "logs"
    logdir.mkdir()
    L.episode(logdir, "a", simple, harness="tidy")
    d = json.loads(run("drift", logdir, "--json")[1].splitlines()[-1])
    assert d["retokenize_differing_tokens"] == 0 and d["trainable_tokens"] > 0


def test_watch_writes_complete_groups_and_flags_timeouts(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    stop = threading.Event()
    result = {}

    def run_watch():
        result["r"] = watch(logdir, out, Options(group_by="task_id", group_size=2), poll=0.05, group_timeout=1.5,
                            should_stop=stop.is_set)
    t = threading.Thread(target=run_watch)
    t.start()
    try:
        L.episode(logdir, "a0", simple, metadata={"task_id": "a"}, harness="tidy")
        L.episode(logdir, "b0", simple, metadata={"task_id": "b"}, harness="tidy")
        time.sleep(0.4)
        assert not list(out.glob("shard-*"))  # half groups are not written
        L.episode(logdir, "a1", whitespace, metadata={"task_id": "a"}, harness="qwen-code")
        deadline = time.time() + 20
        while len(list(out.glob("shard-*"))) < 2 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        t.join(30)
    shards = sorted(out.glob("shard-*.parquet"))
    first, second = pl.read_parquet(shards[0]), pl.read_parquet(shards[1])
    assert sorted(first["episode_id"]) == ["a0", "a1"] and first["group_complete"].all()
    assert second["episode_id"].to_list() == ["b0"] and not second["group_complete"].any()
    assert result["r"].timed_out_groups == ["b"]


def test_console_script_runs(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a", simple, harness="tidy")
    exe = Path(sys.executable).with_name("polar-recon")
    assert exe.exists(), "polar-recon console script missing: pip install -e ."
    r = subprocess.run([str(exe), "build", str(logdir), str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "built 1 episodes" in r.stdout and (out / "shard-000000.parquet").exists()


def test_end_record_scan_agrees_with_read_episode(tmp_path):
    """Grouping reads only message headers and the last batch; it must agree with the full reader,
    on torn, corrupt, unfinished and reopened (concatenated-stream) logs."""
    from polar_contracts.log.arrays import read_head
    from polar_contracts.log.reader import read_episode
    from polar_contracts.log.table import LogError

    make_logdir(tmp_path)
    w = EpisodeWriter(tmp_path / "re.arrow", "re")
    w.append_call(call_index=w.next_call_index(), prompt_ids=[1, 2, 3], completion_ids=[4], completion_logprobs=[-1.0])
    w.close()
    w = EpisodeWriter(tmp_path / "re.arrow", "re")
    w.append_call(call_index=w.next_call_index(), prompt_ids=[1, 2, 3, 4, 5], completion_ids=[6], completion_logprobs=[-1.0])
    w.end(0.5, {"a": 1})
    for p in sorted(tmp_path.glob("*.arrow")):
        try:
            e = read_episode(p)
        except LogError:
            with pytest.raises(LogError, match=p.name):
                read_head(p)
            continue
        h = read_head(p)
        assert (h.finished, h.reward, h.metadata, h.n_calls) == (e.finished, e.reward, e.metadata, e.calls.height), p.name


def test_watch_cli_exits_when_idle(tmp_path):
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a", simple, harness="tidy")
    L.episode(logdir, "b", simple, reward=None, harness="tidy")
    L.episode(logdir, "c", simple, reward=1.0, harness="tidy", metadata={"status": "error", "discard": True})
    code, text = run("watch", logdir, out, "--poll", "0.05", "--idle-exit", "0.3")
    assert code == 0 and "watch done: 1 episodes, 1 shards" in text
    assert text.count("no reward (1): b") == 1  # reported once, not every poll
    assert text.count("discarded by the rollout (metadata.discard) (1): c") == 1
    code, text = run("watch", logdir, out, "--group-by", "task_id")
    assert code == 2 and "needs --group-size" in text


def test_a_discarded_episode_never_completes_a_group(tmp_path):
    """A group of 2 where one episode was discarded (Ctrl-C) waits for a real second episode."""
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a0", simple, metadata={"group_id": "a"}, harness="tidy")
    L.episode(logdir, "a1", simple, metadata={"group_id": "a", "status": "interrupted", "discard": True},
              harness="tidy")
    L.episode(logdir, "b0", simple, metadata={"group_id": "b"}, harness="tidy")
    L.episode(logdir, "b1", whitespace, metadata={"group_id": "b"}, harness="qwen-code")
    rep = build(logdir, out, Options(group_size=2))
    assert rep.discarded == ["a1"] and rep.waiting == {"a": 1} and sorted(rep.built) == ["b0", "b1"]
    assert sorted(read_shards(out)["episode_id"].unique()) == ["b0", "b1"]
    # the retry under a new attempt id completes the group
    L.episode(logdir, "a1.a1", simple, metadata={"group_id": "a"}, harness="tidy")
    rep = build(logdir, out, Options(group_size=2))
    assert sorted(rep.built) == ["a0", "a1.a1"] and rep.discarded == ["a1"]
    assert "a1" not in set(read_shards(out)["episode_id"])


def test_one_builder_per_out(tmp_path):
    from polar_recon.shard_writer import Manifest

    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    L.episode(logdir, "a", simple, harness="tidy")
    held = Manifest.open(out, "token")  # e.g. a running `polar-recon watch`
    try:
        code, text = run("build", logdir, out)
        assert code == 1 and "another polar-recon build/watch is writing here" in text
    finally:
        held.close()
    assert run("build", logdir, out)[0] == 0


def test_trainer_shard_source_reads_the_shards(tmp_path):
    """The consumer side of the contract: trainer/shard_source.py checks every row's invariants."""
    from trainer.shard_source import ShardSource

    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    convs = make_logdir(logdir)
    run("build", logdir, out, "--group-by", "task_id")
    src = ShardSource(str(out))
    groups = []
    while (g := src.try_next()) is not None:
        groups.append(g)
    assert sorted(g.group_id for g in groups) == ["t1", "t2"]
    assert sorted(e for g in groups for e in g.episodes) == sorted(convs)
    assert all(g.complete and g.versions == ["1"] for g in groups)  # (opaque strings: trainer/shard_source.py)


def test_auxiliary_calls_between_agent_calls_are_left_out_of_the_shards(tmp_path):
    """Claude Code's title call can land between two agent calls (recipes' [[auxiliary]], flagged by
    the addon's translator): recorded in the log, never part of a trained sequence."""
    logdir = tmp_path / "logs"
    logdir.mkdir()

    def run_(c):
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        L.auxiliary_call(c.w)
        c.call(L.Sample("Check it.", "", [("run_shell", json.dumps({"command": "cat hello.txt"}))]), results=["hi"])
        L.auxiliary_call(c.w, "Write a 5-word title for: check hello.txt")
        c.call(L.Sample("Done.", "hello.txt contains hi.", []))
    conv = L.episode(logdir, "e", run_, harness="tidy")
    aux_ids = L.encode('{"title": "Create hello file"}<|im_end|>')
    for strategy, n_seqs in (("token", 1), ("per-call", 3)):
        out = tmp_path / strategy
        rep = build(logdir, out, Options(strategy=strategy))
        assert rep.built == ["e"] and not rep.errors
        df = read_shards(out)
        assert df.height == n_seqs and df["n_calls"].sum() == 3
        trained = [x for row in df.iter_rows(named=True)
                   for x, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert trained == sum((r.completion_ids for r in conv.recorded), [])
        for row in df.iter_rows(named=True):  # neither the title prompt nor its answer sits anywhere
            text = L.tokenizer().decode(row["input_ids"])
            assert "5-word title" not in text and '"title"' not in text
            ids = row["input_ids"]
            assert not any(ids[k:k + len(aux_ids)] == aux_ids for k in range(len(ids)))


def test_shards_carry_the_sampling_the_server_applied(tmp_path):
    """The trainer must compute logprobs under the server's sampling transform: each row carries the
    calls' sampling columns (log schema v3). A log whose rows have none (the proxy could not know,
    or a v2 log) falls back to what the request set; calls that differ give null plus a reason."""
    from polar_contracts.sampling_fields import MIXED, request_params

    logdir = tmp_path / "logs"
    logdir.mkdir()
    qwen = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "logprobs_mode": "processed"}

    def at(t):
        def run_(c):
            if t is not None:
                c.sampling = {"temperature": t, "top_p": 0.9}
            simple(c)
        return run_

    def mixed(c):
        c.log_fields = dict(qwen)
        c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
        c.log_fields = dict(qwen, temperature=1.0, sampling_unsupported="presence_penalty=0.5")
        c.call(L.Sample("Done.", "Done.", []))
    L.episode(logdir, "warm", at(0.7), harness="tidy")
    L.episode(logdir, "default", at(None), harness="tidy")
    L.episode(logdir, "greedy", at(0), harness="tidy")
    L.episode(logdir, "mixed", mixed, harness="tidy")
    L.episode(logdir, "recorded", simple, harness="tidy", log_fields=qwen)
    rep = build(logdir, tmp_path / "out", Options())
    assert sorted(rep.built) == ["default", "greedy", "mixed", "recorded", "warm"], rep.errors
    df = read_shards(tmp_path / "out")
    cols = ["temperature", "top_p", "top_k", "min_p", "logprobs_mode", "sampling_unsupported"]
    got = {r["episode_id"]: tuple(r[c] for c in cols) for r in df.iter_rows(named=True)}
    assert got == {
        "warm": (0.7, 0.9, None, None, None, None),  # from the request; unset ones unknown
        "default": (None, None, None, None, None, None),
        "greedy": (0.0, 1.0, -1, 0.0, None, None),  # greedy: the truncations are moot
        "mixed": (None, 0.95, 20, 0.0, "processed", f"presence_penalty=0.5; {MIXED}"),
        "recorded": (0.6, 0.95, 20, 0.0, "processed", None),
    }
    from polar_recon.diagnostics import shard_stats
    st = shard_stats(tmp_path / "out")
    assert st["logprobs_modes"] == {"None": 3, "processed": 2} and st["sampling_unsupported_rows"] == 1
    # only the top-level field counts; a message that talks about temperature is not a setting
    assert request_params(json.dumps({"messages": [{"content": '"temperature": 3'}]}))["temperature"] is None
    assert request_params(json.dumps({"temperature": 1, "top_k": 0, "messages": []})) == {
        "temperature": 1.0, "top_p": None, "top_k": -1, "min_p": None}
    assert request_params(None)["temperature"] is None


def test_watch_goes_on_when_one_episode_hits_a_bug(tmp_path, monkeypatch):
    """An unexpected exception on one episode (a bug, e.g. the closed loop's crash on a sampled id past the
    tokenizer) is reported for that episode; the watch builds the others and keeps running, so a trainer
    waiting on shards is not left to time out on a dead watcher."""
    from polar_recon import build as build_mod
    logdir, out = tmp_path / "logs", tmp_path / "out"
    logdir.mkdir()
    for e in ("a", "b", "c"):
        L.episode(logdir, e, simple, harness="tidy")
    real = build_mod.Builder.sequences

    def sequences(self, path):
        if Path(path).name == "b.arrow":
            raise RuntimeError("boom")
        return real(self, path)
    monkeypatch.setattr(build_mod.Builder, "sequences", sequences)
    code, text = run("watch", logdir, out, "--poll", "0.05", "--idle-exit", "0.3")
    assert code == 0 and "watch done: 2 episodes" in text, text
    assert "episode b: internal error (a bug in polar-recon, please report it): RuntimeError: boom" in text
    assert sorted(read_shards(out)["episode_id"].unique().to_list()) == ["a", "c"]
