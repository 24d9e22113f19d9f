"""The experiment file (harness_recipes/experiment.py) and `polar-rollout fleet --config FILE --dry-run`:
the bundled paper config checks and plans; each kind of mistake is an error naming the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from harness_recipes.experiment import ExperimentError, load_experiment, plan, ray_resources

from .test_cli import cli

PAPER = Path(__file__).resolve().parents[2] / "harness_recipes" / "experiments" / "polar-swebench-qwen3.5-4b.toml"


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
    res = cli("fleet", "--config", str(PAPER))
    assert res.returncode == 2 and "--config runs only with --dry-run" in res.stderr


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
