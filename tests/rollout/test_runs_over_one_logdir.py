"""Runs over one proxy logdir, and what the server said: a second run into a new --out never reuses
an episode the first ended, and builds only its own episodes; a model the server does not serve is
refused up front, and an episode whose every call the server refused is an error with its message."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.node.upstream import error_message, upstream_failure
from tests.support.servers import tiny_model_dir

from .conftest import fake_recipe, write_tasks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """polar-serve (the tiny model, serving `polar-model`) behind a secured capture proxy."""
    logdir = tmp_path_factory.mktemp("shared") / "logs"
    with serve(tiny_model_dir(), model_name="polar-model") as srv, capture_proxy(srv.url, logdir) as proxy:
        yield proxy, logdir


def run(tmp_path, proxy, logdir, out, recipe, *extra):
    return subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", str(recipe), "--tasks",
         str(write_tasks(tmp_path)), "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file),
         "--logdir", str(logdir), "--out", str(out), "--no-progress", "--isolation", "none", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300)


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]


def shard_episodes(out: Path) -> set[str]:
    return set(pl.read_parquet(sorted(out.glob("shard-*.parquet")))["episode_id"].to_list())


def test_a_second_run_into_a_new_out_over_the_same_logdir(tmp_path, stack):
    proxy, logdir = stack
    fix = fake_recipe(tmp_path, ["chat", "1", "fix", "calc.py", "return a - b", "return a + b"], name="fix", via="path")
    first = run(tmp_path, proxy, logdir, tmp_path / "out1", fix)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(tmp_path, proxy, logdir, tmp_path / "out2", fix)
    assert second.returncode == 0, second.stderr[-3000:] + proxy.output()[-2000:]
    (r1,), (r2,) = records(tmp_path / "out1"), records(tmp_path / "out2")
    assert r1["episode_id"] == "add0.s0" and r2["episode_id"] == "add0.s0.a1", (r1, r2)
    assert r2["status"] == "done" and r2["reward"] == 1.0 and r2["n_calls"] == 1, r2
    # each OUT holds its own run's episodes only
    assert shard_episodes(tmp_path / "out1") == {"add0.s0"}
    assert shard_episodes(tmp_path / "out2") == {"add0.s0.a1"}
    assert sorted(p.name for p in (tmp_path / "out2" / "rollout" / "logs").iterdir()) == ["add0.s0.a1.arrow"]
    # the preflight's model listing opened no episode
    assert not list(logdir.glob("polar-rollout-preflight*"))


def test_a_model_the_server_does_not_serve_is_refused_up_front(tmp_path, stack):
    proxy, logdir = stack
    fix = fake_recipe(tmp_path, ["chat", "1", "noop"], name="fix", via="path")
    res = run(tmp_path, proxy, logdir, tmp_path / "out", fix, "--model", "no-such-model")
    assert res.returncode == 1, res.stderr
    assert "--model no-such-model: the server behind the proxy serves polar-model" in res.stderr
    assert "Pass --model polar-model" in res.stderr
    assert not (tmp_path / "out" / "rollout" / "episodes.jsonl").exists()


def test_an_episode_whose_every_call_failed_upstream_is_an_error_with_the_servers_message(tmp_path, stack):
    """The recipe asks for a fixed model name the server does not serve (the preflight checks
    --model, which is right): every call gets the server's 404."""
    proxy, logdir = stack
    recipe = fake_recipe(tmp_path, ["chat", "1", "noop"], name="fixed", via="path")
    recipe.write_text(recipe.read_text().replace('FAKE_MODEL = "${model}"', 'FAKE_MODEL = "other-model"'))
    res = run(tmp_path, proxy, logdir, tmp_path / "out", recipe, "--recon", "none")
    assert res.returncode == 3, res.stderr
    (rec,) = records(tmp_path / "out")
    assert rec["status"] == "error", rec
    assert rec["error"].startswith("RuntimeError: every model call failed upstream (1 of 1): HTTP 404 The model "
                                   "`other-model` does not exist"), rec["error"]
    assert "other-model" in res.stderr  # the plain progress line names it too
    from polar_contracts.log.reader import read_episode
    log = read_episode(logdir / f"{rec['episode_id']}.arrow")
    assert log.finished and log.metadata["discard"] is True and log.metadata["status"] == "error"


def test_upstream_failure_reads_the_calls():
    ok = pl.DataFrame({"status": [404, 200], "response": ["{}", "{}"], "error": [None, None]})
    assert upstream_failure(ok) == ""
    assert upstream_failure(ok.head(0)) == ""
    bad = pl.DataFrame({"status": [404, None], "response": ['{"object": "error", "message": "The model x does not '
                                                            'exist.", "code": 404}', None],
                        "error": ["no token ids", "upstream connection failed"]})
    assert upstream_failure(bad) == "every model call failed upstream (2 of 2): HTTP 404 The model x does not exist."
    assert error_message(500, '{"error": {"message": "boom"}}', None) == "HTTP 500 boom"
    assert error_message(None, None, "upstream connection failed") == "upstream connection failed"
    assert error_message(502, "Bad Gateway", None) == "HTTP 502 Bad Gateway"
