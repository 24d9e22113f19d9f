"""The experiment file (harness_recipes/fleet/experiment.py) and `polar-rollout fleet --config FILE --dry-run`:
the bundled paper config checks and plans; each kind of mistake is an error naming the key."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.fleet.experiment import ExperimentError, load_experiment, plan, ray_resources

from .test_cli import cli

PAPER = Path(__file__).resolve().parents[2] / "harness_recipes" / "fleet" / "experiments" / "polar-swebench-qwen3.5-4b.toml"


def test_the_paper_config_checks_and_plans_one_fleet_per_harness():
    exp = load_experiment(PAPER)
    assert exp.rollout["harnesses"] == ["codex", "claude-code", "qwen-code", "pi"]
    assert ray_resources(exp)["per_node"] == {"CPU": 32 + 8}
    lines = plan(exp)
    fleets = [x for x in lines if x.strip().startswith("polar-rollout fleet")]
    assert len(fleets) == 4 and all("--ray-address auto --proxies-per-node 8" in f for f in fleets)
    assert any(x.startswith("trainer: accelerate launch --num_processes 8") for x in lines)
    # the SWE-bench file is the cluster's: not on this machine, and the plan says so
    assert any(x.startswith("NOT CHECKED HERE: SWE-bench file /shared/swebench/verified.jsonl") for x in lines)


def test_dry_run_from_the_command_line():
    res = cli("fleet", "--config", str(PAPER), "--dry-run")
    assert res.returncode == 0 and "polar-rollout fleet --recipe pi" in res.stdout, res.stderr
    res = cli("fleet", "--config", str(PAPER), "--local", "1")  # runs need the tasks here: none are
    assert res.returncode == 2 and "the tasks cannot be loaded on this machine" in res.stderr, res.stderr
    res = cli("fleet", "--config", str(PAPER), "--recipe", "pi", "--store", "file:///x")
    assert res.returncode == 2 and "--config FILE says what --recipe, --store would" in res.stderr, res.stderr


@pytest.mark.parametrize("edit, message", [
    (("[fleet]", "[fleet]\nnode = 3"), "[fleet] unknown keys ['node']"),
    (('engine = "sglang"', 'engine = "tgi"'), "[server].engine must be one of"),
    (('"codex", ', '"codx", '), "recipe not found: codx"),
    (("learning_rate = 1e-6", "learnig_rate = 1e-6"), "not flags of polar-train"),
    (("sync_steps = 1", "sync_steps = 1\nshards = \"x\""), "leave it out"),
    (('store = "s3://polar-runs/swebench-qwen3.5-4b"', 'store = "polar-runs"'), "must be a filesystem URI"),
    (("nodes = 8", "nodes = 0"), "[fleet].nodes must be >= 1"),
    (("samples = 8", 'samples = "8"'), "[rollout].samples must be int"),
])
def test_mistakes_name_the_key(tmp_path, edit, message):
    f = tmp_path / "exp.toml"
    text = PAPER.read_text()
    assert edit[0] in text
    f.write_text(text.replace(edit[0], edit[1], 1))
    with pytest.raises(ExperimentError) as ei:
        load_experiment(f)
    assert message in str(ei.value) and str(f) in str(ei.value)


def test_config_runs_one_fleet_per_harness_into_its_own_store(tmp_path):
    """``fleet --config FILE`` (no --dry-run) on a 1-node local Ray cluster: two (fake) harnesses, one
    after the other, each into <store>/<harness>, a real polar-serve behind the real proxies."""
    import httpx

    from harness_recipes.fleet.store import Store
    from tests.support.servers import polar_serve, tiny_model_dir

    from .conftest import fake_recipe, write_tasks

    pytest.importorskip("ray", reason="polar-rollout fleet needs Ray (pip install 'polar[fleet]')")
    harnesses = [fake_recipe(tmp_path, ["chat", "1", "fix", "calc.py", "return a - b", "return a + b"],
                             name=f"exp{i}", via="path") for i in range(2)]
    tasks = write_tasks(tmp_path, n=2)
    with polar_serve(tiny_model_dir(), "vllm") as srv:
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        text = PAPER.read_text()
        for old, new in [('harnesses = ["codex", "claude-code", "qwen-code", "pi"]',
                          f"harnesses = [{', '.join(repr(str(h)) for h in harnesses)}]"),
                         ('swebench = "/shared/swebench/verified.jsonl"', f'tasks = "{tasks}"\nisolation = "none"'),
                         ('repos = "/shared/swebench/repos"', ""), ("samples = 8", "samples = 2"),
                         ('runtime = "docker"', 'runtime = "local"'), ("concurrency = 32", "concurrency = 2"),
                         ("prewarm = 16", "prewarm = 1"), ("eval_concurrency = 16", "eval_concurrency = 1"),
                         ('url = "http://inference-0:30000"', f'url = "{srv.base_url}"'),
                         ('served_name = "polar-model"', f'served_name = "{model}"'),
                         ("proxies_per_node = 8", "proxies_per_node = 1"),
                         ('store = "s3://polar-runs/swebench-qwen3.5-4b"', f'store = "file://{tmp_path}/store"')]:
            assert old in text, old
            text = text.replace(old, new, 1)
        exp = tmp_path / "exp.toml"
        exp.write_text(text)
        res = subprocess.run([sys.executable, "-m", "harness_recipes.cli", "fleet", "--config", str(exp), "--local",
                              "1", "--no-progress", "--node-dir", str(tmp_path / "n")],
                             cwd=PAPER.parents[2], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("4 episodes on 1 nodes") == 2, res.stdout
    for i in range(2):
        store = Store(f"file://{tmp_path}/store/exp{i}")
        recs = store.records()
        assert sorted(r["episode_id"] for r in recs) == ["add0.s0", "add0.s1", "add1.s0", "add1.s1"]
        assert {r["status"] for r in recs} == {"done"} and {r["reward"] for r in recs} == {1.0}
        assert len([f for f in store.list("shards") if f.endswith(".parquet")]) >= 1
