"""SWE-bench episodes on the docker runtime: the instance's image, swebench's grading, and bad input.

A fix graded resolved (reward 1.0), no fix graded unresolved (reward 0.0, a real model failure,
kept for training); and the failures that are not the model's, found outside the graded code: an
image that cannot be built, a test_patch that does not apply, a container that dies. Each of those
ends its episode with a recorded status and reason, discarded (never a reward 0 that reads as the
model's failure), and the run goes on with the other episodes. Tests that hang and a log with no
test output are the graded code's: a kept 0.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import harness_recipes.node.episode as ep
from harness_recipes.node.records import Records
from harness_recipes.node.scheduler import Limits, Pipeline
from harness_recipes.recipes.recipe import load_recipe
from harness_recipes.tasks.swebench.instances import load_instances

from .conftest import fake_harness_installed

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / "data" / "swebench" / "mini.jsonl"
INFLECTION = "jpvanhal__inflection-ordinal-thirteen"
FIX = ["fix", "inflection/__init__.py", "number % 100 in (11, 12):", "number % 100 in (11, 12, 13):"]


def inflection():
    (task,) = load_instances(MINI, instances=[INFLECTION])
    return task


def variant(task, tag: str, **inst):
    """The inflection task under another id, with some instance fields changed."""
    return dataclasses.replace(task, id=f"{task.id}-{tag}", swebench={**task.swebench, **inst})


def run(tmp_path, monkeypatch, end_server, runtime_cls, argv, tasks, on_start=None):
    recipe_path, exe = fake_harness_installed(tmp_path, monkeypatch, argv)
    rt = runtime_cls(network="none", memory="1g", cpus=1.0, workdir=str(tmp_path))
    records = Records(tmp_path / "out")
    p = Pipeline(load_recipe(recipe_path), exe, rt, ep.Settings(proxy=end_server.url), records,
                 logdir=None, limits=Limits())
    p.plan(tasks, 1)

    async def go():
        try:
            return await p.run()
        finally:
            await rt.shutdown()

    if on_start:
        threading.Thread(target=on_start, args=(rt,), daemon=True).start()
    recs = {r["task_id"]: r for r in asyncio.run(go())}
    assert rt.leftovers() == [], "containers left behind"
    return recs, records


def test_fixed_is_resolved_and_the_bad_instances_are_recorded_not_scored(tmp_path, monkeypatch, end_server,
                                                                        docker_runtime_cls):
    t = inflection()
    lines = t.swebench["test_patch"].splitlines()
    ctx = next(i for i, line in enumerate(lines) if line.startswith(" ") and line.strip())
    lines[ctx] = " this line is not in test_inflection.py"
    tasks = [
        t,
        variant(t, "noimage", base_commit="0" * 40),
        variant(t, "badpatch", test_patch="\n".join(lines) + "\n"),
        dataclasses.replace(variant(t, "hang", eval_script=t.swebench["eval_script"].replace(
            "python3 -m pytest", "sleep 600; python3 -m pytest")), eval_timeout=3),
        # a test command that runs no test at all (a broken instance, not a broken fix)
        variant(t, "noout", eval_script=t.swebench["eval_script"].replace(
            "python3 -m pytest -rA -p no:cacheprovider test_inflection.py", "true")),
    ]
    recs, records = run(tmp_path, monkeypatch, end_server, docker_runtime_cls, FIX, tasks)

    ok = recs[t.id]
    assert ok["status"] == "done" and ok["reward"] == 1.0 and ok["swebench"]["resolved"] is True, ok
    assert not ok["swebench"]["tests"]["FAIL_TO_PASS"]["failure"]
    assert sorted(ok["swebench"]["tests"]["FAIL_TO_PASS"]["success"]) == sorted(t.swebench["FAIL_TO_PASS"])
    end = end_server.ends[ok["episode_id"]]
    assert end["reward"] == 1.0 and end["metadata"]["discard"] is False
    assert end["metadata"]["eval"]["resolved"] is True and end["metadata"]["eval"]["instance_id"] == INFLECTION
    assert end["metadata"]["eval"]["kind"] == "swebench"
    # the official log and report, kept with the episode
    edir = records.episode_dir(ok["episode_id"])
    assert (edir / "report.json").is_file() and ">>>>> End Test Output" in (edir / "test_output.txt").read_text()
    patch = (edir / "model.patch").read_text()
    assert "+    elif number % 100 in (11, 12, 13):" in patch or "(11, 12, 13)" in patch, patch
    assert "b/.fake-seen.json" in patch, patch  # a new file the harness wrote is part of the model's patch

    bad = recs[f"{t.id}-noimage"]
    assert bad["status"] == "error" and "image build failed" in bad["error"] and "0000000000" in bad["error"], bad
    # the harness never ran: no capture log to close, so no end was posted
    assert bad["episode_id"] not in end_server.ends

    bp = recs[f"{t.id}-badpatch"]
    assert bp["status"] == "eval_error" and "test_patch does not apply" in bp["error"], bp
    assert end_server.ends[bp["episode_id"]]["metadata"]["discard"] is True
    assert "test_patch does not apply" in end_server.ends[bp["episode_id"]]["metadata"]["reason"]

    # Once the tests run, their output is the graded code's: tests that hang and a log swebench reads
    # nothing from are a graded 0, kept (a discard would let a failing policy escape its negative
    # advantage: docs/security.md, the verdict); every episode of a broken instance gets the same 0, which trains nothing.
    hang = recs[f"{t.id}-hang"]
    assert hang["status"] == "done" and hang["reward"] == 0.0 and hang["eval"]["verdict"] == "timed_out", hang
    assert end_server.ends[hang["episode_id"]]["metadata"]["discard"] is False

    noout = recs[f"{t.id}-noout"]
    assert noout["status"] == "done" and noout["reward"] == 0.0 and noout["eval"]["verdict"] == "unreadable", noout
    assert end_server.ends[noout["episode_id"]]["metadata"]["discard"] is False


def test_no_fix_is_a_real_unresolved_episode(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    t = inflection()
    recs, _ = run(tmp_path, monkeypatch, end_server, docker_runtime_cls, ["noop"], [t])
    rec = recs[t.id]
    assert rec["status"] == "done" and rec["reward"] == 0.0 and rec["swebench"]["resolved"] is False, rec
    assert sorted(rec["swebench"]["tests"]["FAIL_TO_PASS"]["failure"]) == sorted(t.swebench["FAIL_TO_PASS"])
    assert not rec["swebench"]["tests"]["PASS_TO_PASS"]["failure"]
    end = end_server.ends[rec["episode_id"]]
    assert end["reward"] == 0.0 and end["metadata"]["discard"] is False  # the model's failure: a training signal


def test_a_fix_that_breaks_the_module_is_graded_unresolved(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    """The model's own failure, however loud (the tests cannot even import), is a graded 0, not an eval error."""
    t = inflection()
    recs, _ = run(tmp_path, monkeypatch, end_server, docker_runtime_cls,
                  ["fix", "inflection/__init__.py", "def ordinal(", "def ordinal(("], [t])
    rec = recs[t.id]
    assert rec["status"] == "done" and rec["reward"] == 0.0 and rec["swebench"]["resolved"] is False, rec
    assert rec["swebench"]["patch_successfully_applied"] is True
    assert end_server.ends[rec["episode_id"]]["metadata"]["discard"] is False


def test_a_container_that_dies_ends_its_episode_with_the_reason(tmp_path, monkeypatch, end_server,
                                                                docker_runtime_cls):
    t = inflection()
    tasks = [variant(t, "dies"), t]

    def kill_first(rt):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for c in rt.client.containers.list(filters={"label": f"polar.episode={t.id}-dies.s0"}):
                time.sleep(1.0)  # inside the harness's sleep
                c.kill()
                return
            time.sleep(0.1)

    # The harness sleeps 8 s: long enough to be killed in, short enough for the other episode.
    recs, _ = run(tmp_path, monkeypatch, end_server, docker_runtime_cls, ["sleep", "8"], tasks, on_start=kill_first)
    dead = recs[f"{t.id}-dies"]
    assert dead["status"] == "error" and "died" in dead["error"] and "exit code" in dead["error"], dead
    assert end_server.ends[dead["episode_id"]]["metadata"]["discard"] is True
    # the run went on: the other episode was graded (no fix: unresolved, status done)
    assert recs[t.id]["status"] == "done" and recs[t.id]["swebench"]["resolved"] is False


def test_the_official_image_is_used_when_the_local_docker_has_it(docker_runtime_cls):
    from harness_recipes.docker_engine import docker_client
    from harness_recipes.tasks.swebench.images import instance_image, official_name
    t = inflection()
    client = docker_client()
    name = official_name(t.swebench)
    # swebench's own naming: sweb.eval.<arch>.<instance_id>:latest, lower case
    assert name == f"sweb.eval.x86_64.{INFLECTION.lower()}:latest"
    built, how = instance_image(client, t.swebench, t.git_repo)
    assert how in ("built", "cached") and built.startswith("polar-sweb.eval.")
    repo, tag = name.split(":")
    client.images.get(built).tag(repo, tag)  # stands in for an image built by swebench's builder
    try:
        assert instance_image(client, t.swebench, t.git_repo) == (name, "official")
        # a row naming its image (swebench 5 datasets) is taken at its word when docker has it
        assert instance_image(client, {**t.swebench, "image": built}, None) == (built, "instance")
    finally:
        client.images.remove(name)
    assert instance_image(client, t.swebench, t.git_repo) == (built, "cached")
