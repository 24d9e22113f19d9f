"""The real harness CLIs (the six npm ones, mini-swe-agent, aider) through mitmdump + the Polar addon + polar-serve (scripted).

For each harness, `polar-rollout run` on the fix-add sample task must: fix the bug (the task's
file change happened, its test passes: reward 1.0), leave a finished capture log where every
call has prompt ids, completion ids and logprobs, and `polar-recon build` must turn it into a
valid shard row. Needs the CLIs in .cache/harnesses (ensure_installed installs them).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.recipes.install import ensure_installed
from harness_recipes.recipes.recipe import load_recipe
from harness_recipes.tasks.samples import sample_task_file

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "data" / "tasks"
SCRIPT = TASKS / "scripts" / "fix_tasks.json"
CASES = [("pi", "local"), ("qwen-code", "local"), ("codex", "local"), ("claude-code", "local"), ("pi", "docker"),
         ("gemini-cli", "local"), ("opencode", "local"),
         # PyPI harnesses; both reach the proxy by the /polar/<id>/ path prefix (litellm sends no custom header).
         ("mini-swe-agent", "local"), ("aider", "local")]
MIN_CALLS = {"aider": 1}  # aider answers with one edit block; the others fix, test, then answer


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.support.servers import tiny_model_dir
    logdir = tmp_path_factory.mktemp("logs")
    with serve(tiny_model_dir(), script=SCRIPT) as srv, capture_proxy(srv.url, logdir) as proxy:
        yield proxy, logdir


@pytest.mark.parametrize("harness,runtime", CASES)
def test_real_harness_fixes_the_task_and_is_captured(stack, tmp_path, harness, runtime):
    proxy, logdir = stack
    if runtime == "docker":
        from harness_recipes.docker_engine import docker_client
        try:
            docker_client()
        except RuntimeError as e:
            pytest.skip(f"dockerd not reachable, docker runtime not tested here: {e}")
    ensure_installed(load_recipe(harness))
    out = tmp_path / "out"
    tag = f"{harness}-{runtime}"
    proc = subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", harness, "--tasks", str(sample_task_file(tmp_path, tag)),
         "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir),
         "--out", str(out), "--no-progress",
         "--recon", "watch" if runtime == "docker" else "build", "--runtime", runtime],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    detail = f"{rec}\nproxy output:\n{proxy.output()[-3000:]}"
    assert rec["status"] == "done" and rec["harness_rc"] == 0 and rec["runtime"] == runtime, detail
    assert "calc.py" in rec["changed_files"] and rec["reward"] == 1.0, detail

    from polar_contracts.log.reader import read_episode
    log = read_episode(logdir / f"{rec['episode_id']}.arrow")
    assert log.finished and log.reward == 1.0 and log.metadata["group_id"] == f"fix-add-{tag}"
    calls = log.calls.filter(~log.calls["auxiliary"].fill_null(False))
    assert calls.height >= MIN_CALLS.get(harness, 3), f"expected fix, test and final-answer calls, got {calls.height}"
    for row in calls.iter_rows(named=True):
        assert row["error"] is None and row["status"] == 200, row["error"]
        assert row["prompt_ids"] and row["completion_ids"], f"call {row['call_index']} has no ids"
        assert len(row["completion_logprobs"]) == len(row["completion_ids"])
    assert rec["n_calls"] == log.calls.height

    # The recipe's [[auxiliary]] rules travel in the end metadata and the log reader flags what they
    # match (OpenCode's title call is a plain chat call: no translator can recognise it).
    from polar_contracts.auxiliary import METADATA_KEY
    from polar_contracts.log.arrays import read_calls
    recipe = load_recipe(harness)
    assert [r["name"] for r in log.metadata.get(METADATA_KEY, [])] == [a.name for a in recipe.auxiliary]
    flagged = [c for c in read_calls(logdir / f"{rec['episode_id']}.arrow").calls if c.info.get("auxiliary_rule")]
    assert all(not c.usable and c.why_unusable == "auxiliary" for c in flagged)
    if harness == "opencode":
        assert [c.info["auxiliary_rule"] for c in flagged] == ["session-title"], "OpenCode's title call is not flagged"

    # polar-rollout built the shards into OUT (recon build, or watch + a final build).
    import polars as pl
    df = pl.read_parquet(out / "shard-*.parquet").filter(pl.col("episode_id") == rec["episode_id"])
    assert df.height >= 1
    for row in df.iter_rows(named=True):
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
        assert sum(row["loss_mask"]) > 0 and row["reward"] == 1.0 and row["group_id"] == f"fix-add-{tag}"
