"""The scheduler with a fake harness: statuses, rewards, resume, timeouts, crashes, pipelining."""
from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

import harness_recipes.node.episode as ep
from harness_recipes.node.records import Records
from harness_recipes.node.scheduler import Limits, Pipeline
from harness_recipes.recipes.recipe import load_recipe
from harness_recipes.runtimes import make_runtime
from harness_recipes.tasks.task_file import load_tasks

from .conftest import FAKE, fake_recipe, write_tasks

FIX = ["fix", "calc.py", "return a - b", "return a + b"]


def run_pipeline(tmp_path, end_server, argv, *, n=1, samples=1, timeout=30, limits=None, isolation="auto"):
    recipe = load_recipe(fake_recipe(tmp_path, argv))
    tasks = load_tasks(write_tasks(tmp_path, timeout=timeout, n=n))
    out = tmp_path / "out"
    records = Records(out)
    # the fake harness lives in the checkout, which a sandbox does not see: bind it alone
    opts = {"extra_ro": (str(FAKE),)} if isolation != "none" else {}
    runtime = make_runtime("local", isolation=isolation, workdir=str(tmp_path), **opts)
    p = Pipeline(recipe, Path(recipe.install.bin), runtime, ep.Settings(proxy=end_server.url), records,
                 logdir=None, limits=limits or Limits())
    p.plan(tasks, samples)
    recs = asyncio.run(p.run())
    return p, recs, out


def leftover_dirs(tmp_path):
    return [d for d in tmp_path.iterdir() if d.name.startswith("polar-")]


@pytest.mark.parametrize("isolation", ["none", "bwrap"])
def test_fixing_harness_gets_reward_one_and_end_is_posted(tmp_path, end_server, isolation):
    if isolation == "bwrap":
        from harness_recipes.runtimes.local import bwrap_available
        if not bwrap_available():
            pytest.skip("bubblewrap missing or cannot create namespaces here (apt-get install -y bubblewrap)")
    p, (rec,), out = run_pipeline(tmp_path, end_server, FIX, isolation=isolation)
    assert rec["status"] == "done" and rec["reward"] == 1.0, rec
    assert rec["changed_files"] == [".fake-seen.json", "calc.py"] or set(rec["changed_files"]) == {".fake-seen.json", "calc.py"}
    end = end_server.ends[rec["episode_id"]]
    assert end["reward"] == 1.0 and end["metadata"]["group_id"] == "add0" and end["metadata"]["discard"] is False
    # every episode says how it was confined: an unsandboxed one is marked so
    assert end["metadata"]["isolation"] == {"none": "none", "bwrap": "bubblewrap"}[isolation]
    assert list(rec["phases"]) == ["prewarm", "run", "eval", "recon"]
    assert not leftover_dirs(tmp_path), "episode directory not removed"
    line = json.loads((out / "rollout" / "episodes.jsonl").read_text().splitlines()[-1])
    assert line["episode_id"] == "add0.s0"


def test_templates_reach_the_harness(tmp_path, end_server):
    from harness_recipes.runtimes.local import LocalRuntime
    recipe = load_recipe(fake_recipe(tmp_path, ["noop"]))
    task = load_tasks(write_tasks(tmp_path))[0]

    async def go():
        rt = LocalRuntime(isolation="none", workdir=str(tmp_path))
        sb = await rt.prepare(task, "add0.s0", Path(recipe.install.bin))
        values = ep.episode_vars(recipe, Path(recipe.install.bin), sb, task, "add0.s0", ep.Settings(proxy="http://p:1/"))
        await ep.write_config(recipe, sb, values)
        env = ep.harness_env(recipe, values, ep.Settings(proxy="http://p:1"), None)
        res = await ep.run_harness(recipe, sb, values, env, 30)
        seen = json.loads((Path(sb.workspace) / ".fake-seen.json").read_text())
        cfg = json.loads((Path(sb.home) / ".fake" / "config.json").read_text())
        await sb.close()
        return res, seen, cfg, env

    res, seen, cfg, env = asyncio.run(go())
    assert res.rc == 0
    assert seen["env"]["FAKE_EPISODE"] == "add0.s0" and seen["env"]["FAKE_BASE"] == "http://p:1"
    assert cfg == {"episode": "add0.s0", "header": "x-polar-episode"}
    assert not any(k.endswith(("TOKEN", "SECRET")) for k in env), "caller's environment leaked into the harness"


@pytest.mark.parametrize("via", ["header", "path"])
def test_a_secured_proxy_gives_the_harness_its_capability_never_the_secret(tmp_path, via):
    """With a control secret the harness's episode name (env, config files, base URL) is the
    episode's capability; the secret appears nowhere the harness can see, and a recipe that
    would render it is refused."""
    from harness_recipes.runtimes.local import LocalRuntime
    from polar_contracts.control import capability, new_secret
    secret = new_secret()
    s = ep.Settings(proxy="http://p:1", control_secret=secret)
    recipe = load_recipe(fake_recipe(tmp_path, ["noop"], via=via))
    task = load_tasks(write_tasks(tmp_path))[0]
    cap = capability(secret, "add0.s0")

    async def go():
        rt = LocalRuntime(isolation="none", workdir=str(tmp_path))
        sb = await rt.prepare(task, "add0.s0", Path(recipe.install.bin))
        values = ep.episode_vars(recipe, Path(recipe.install.bin), sb, task, "add0.s0", s)
        await ep.write_config(recipe, sb, values, s)
        env = ep.harness_env(recipe, values, s, None)
        res = await ep.run_harness(recipe, sb, values, env, 30, s)
        seen = json.loads((Path(sb.workspace) / ".fake-seen.json").read_text())
        files = [p.read_text(errors="replace") for p in Path(sb.home).rglob("*") if p.is_file()]
        files += [p.read_text(errors="replace") for p in Path(sb.workspace).rglob("*") if p.is_file()]
        with pytest.raises(RuntimeError, match="control secret"):  # a recipe that would hand it over
            ep.harness_env(recipe, {**values, "episode": secret}, s, None)
        await sb.close()
        return res, seen, env, files

    res, seen, env, files = asyncio.run(go())
    assert res.rc == 0 and seen["env"]["FAKE_EPISODE"] == cap
    if via == "path":
        assert seen["env"]["FAKE_BASE"] == f"http://p:1/polar/{cap}"
    assert not any(secret in v for v in (*env.values(), *seen["env"].values(), *files))


def test_no_fix_gets_reward_zero(tmp_path, end_server):
    _, (rec,), _ = run_pipeline(tmp_path, end_server, ["noop"])
    assert rec["status"] == "done" and rec["reward"] == 0.0 and rec["eval_rc"] != 0


def test_crash_is_recorded_and_still_evaluated(tmp_path, end_server):
    _, (rec,), out = run_pipeline(tmp_path, end_server, ["crash"])
    assert rec["status"] == "crashed" and rec["harness_rc"] == 3 and rec["reward"] == 0.0
    assert "simulated crash" in rec["harness_stderr_tail"]
    assert (out / "rollout" / rec["episode_id"] / "harness.stderr").read_text().strip() == "fake harness: simulated crash"
    assert end_server.ends[rec["episode_id"]]["metadata"]["status"] == "crashed"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


@pytest.mark.parametrize("isolation", ["none", "auto"])
def test_hang_times_out_and_leaves_nothing_running(tmp_path, end_server, isolation):
    # Under bubblewrap the agent (an unprivileged uid) writes only its workspace, home and private /tmp.
    pidfile = tmp_path / "pids" if isolation == "none" else Path("/tmp/polar-hang-pids")
    _, (rec,), _ = run_pipeline(tmp_path, end_server, ["hang", str(pidfile)], timeout=2, isolation=isolation)
    assert rec["status"] == "timeout" and rec["harness_rc"] is None and rec["reward"] == 0.0
    if isolation == "none":  # under bwrap the pids are those of its own namespace
        for pid in map(int, pidfile.read_text().split()):
            assert not _alive(pid), f"process {pid} survived the timeout"
    assert not leftover_dirs(tmp_path)


def test_end_failure_is_an_error_status(tmp_path, end_server):
    end_server.close()
    _, (rec,), _ = run_pipeline(tmp_path, end_server, FIX)
    assert rec["status"] == "error" and "POST" in rec["error"]


def test_resume_skips_finished_and_retries_errors(tmp_path, end_server):
    p, recs, out = run_pipeline(tmp_path, end_server, FIX, n=2, samples=2)
    assert sorted(r["episode_id"] for r in recs) == ["add0.s0", "add0.s1", "add1.s0", "add1.s1"]
    # Mark one as interrupted, as a Ctrl-C would: it must run again under a new attempt id.
    records = Records(out)
    records.append({**records.latest[("add1", 1)], "status": "interrupted"})
    p2, recs2, _ = run_pipeline(tmp_path, end_server, FIX, n=2, samples=2)
    assert [r["episode_id"] for r in recs2] == ["add1.s1.a1"] and p2.stats.skipped == 3
    assert recs2[0]["status"] == "done"


def test_pipelining_overlaps_phases(tmp_path, end_server):
    # 4 episodes of 1.5 s each, 1 harness slot: the next prewarm must happen during the current run.
    _, recs, _ = run_pipeline(tmp_path, end_server, ["sleep", "1.5"], n=4, limits=Limits(prewarm=2, run=1, eval=2),
                              isolation="none")
    recs = sorted(recs, key=lambda r: r["phases"]["run"][0])
    for a, b in zip(recs, recs[1:]):
        assert b["phases"]["prewarm"][1] <= a["phases"]["run"][1], "next workspace not ready before the slot freed"
        assert b["phases"]["run"][0] >= a["phases"]["run"][1] - 0.01, "more than one harness at a time"
    # The harness slot never waits on an evaluation: runs follow each other back to back.
    gaps = [b["phases"]["run"][0] - a["phases"]["run"][1] for a, b in zip(recs, recs[1:])]
    assert max(gaps) < 0.5, gaps


def test_sequential_mode_does_not_overlap(tmp_path, end_server):
    _, recs, _ = run_pipeline(tmp_path, end_server, ["sleep", "0.2"], n=3, limits=Limits(sequential=True),
                              isolation="none")
    recs = sorted(recs, key=lambda r: r["phases"]["prewarm"][0])
    for a, b in zip(recs, recs[1:]):
        assert b["phases"]["prewarm"][0] >= a["phases"]["recon"][1]


def test_an_eval_that_cannot_run_is_discarded_not_a_zero(tmp_path, end_server):
    """The evaluation's own failure (here: the hidden test patch does not apply) is not the model's: the
    episode ends eval_error with the reason, and its end says discard, so no shard trains on reward 0."""
    import dataclasses
    recipe = load_recipe(fake_recipe(tmp_path, FIX))
    (task,) = load_tasks(write_tasks(tmp_path))
    task = dataclasses.replace(task, eval_patch="--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-x\n+y\n")
    records = Records(tmp_path / "out")
    runtime = make_runtime("local", isolation="none", workdir=str(tmp_path))
    p = Pipeline(recipe, Path(recipe.install.bin), runtime, ep.Settings(proxy=end_server.url), records,
                 logdir=None, limits=Limits())
    p.plan([task], 1)
    (rec,) = asyncio.run(p.run())
    assert rec["status"] == "eval_error" and "eval patch did not apply" in rec["error"], rec
    end = end_server.ends[rec["episode_id"]]
    assert end["metadata"]["discard"] is True and "eval patch did not apply" in end["metadata"]["reason"]


@pytest.mark.parametrize("isolation", ["auto", "bwrap"])
def test_no_silent_fallback_without_bubblewrap(tmp_path, monkeypatch, isolation, capsys):
    """Without bubblewrap on PATH, auto (the default) and bwrap refuse to start, naming what is missing
    and how to get it; only an explicit none runs, with a warning."""
    from harness_recipes.runtimes.local import LocalRuntime
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH where no bwrap is found
    with pytest.raises(RuntimeError, match=r"bubblewrap \(bwrap\) is not installed.*apt-get install -y bubblewrap"):
        LocalRuntime(isolation=isolation, workdir=str(tmp_path))
    rt = LocalRuntime(isolation="none", workdir=str(tmp_path))
    assert rt.isolation == "none" and "UNSANDBOXED" in capsys.readouterr().err
