"""polar-rollout as a user runs it: bad input, Ctrl-C in the middle, resume."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .conftest import fake_recipe, write_tasks
from .test_pipeline import _alive

ROOT = Path(__file__).resolve().parents[2]


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "harness_recipes.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, **kw)


def base_args(tmp_path, recipe, tasks, proxy):
    return ["run", "--recipe", str(recipe), "--tasks", str(tasks), "--proxy", proxy, "--logdir", str(tmp_path / "logs"),
            "--out", str(tmp_path / "out"), "--no-progress", "--recon", "none", "--isolation", "none",
            "--unsafe-open-proxy"]  # (end_server is an open proxy's end point: test_open_proxy.py has the refusal)


def test_bad_task_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "tasks.jsonl"
    bad.write_text('{"id": "a b", "prompt": "p", "eval": "true"}\n')
    res = cli(*base_args(tmp_path, "pi", bad, "http://127.0.0.1:9"))
    assert res.returncode == 2 and "task id 'a b' must match" in res.stderr and "tasks.jsonl:1" in res.stderr
    res = cli(*base_args(tmp_path, "no-such-harness", bad, "http://127.0.0.1:9"))
    assert res.returncode == 2 and "recipe not found: no-such-harness" in res.stderr
    good = write_tasks(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "POLAR_TEST_UNSET_KEY"}
    res = cli(*base_args(tmp_path, "pi", good, "http://127.0.0.1:9"), "--api-key-env", "POLAR_TEST_UNSET_KEY", env=env)
    assert res.returncode == 2 and "POLAR_TEST_UNSET_KEY: that variable is not set" in res.stderr


def test_proxy_down_is_an_error_exit_and_is_retried(tmp_path):
    fix = fake_recipe(tmp_path, ["noop"], name="noop")
    res = cli(*base_args(tmp_path, fix, write_tasks(tmp_path), "http://127.0.0.1:9"))
    assert res.returncode == 3 and "ended in 'error'" in res.stdout + res.stderr
    rec = json.loads((tmp_path / "out" / "rollout" / "episodes.jsonl").read_text())
    assert rec["status"] == "error" and "POST http://127.0.0.1:9/polar/add0.s0/end failed" in rec["error"]


def test_ctrl_c_stops_everything_records_and_resumes(tmp_path, end_server):
    pidfile = tmp_path / "pids"
    tasks = write_tasks(tmp_path, timeout=600, n=2)
    hang = fake_recipe(tmp_path, ["hang", str(pidfile)], name="hang")
    proc = subprocess.Popen([sys.executable, "-m", "harness_recipes.cli",
                             *base_args(tmp_path, hang, tasks, end_server.url)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pidfile.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    assert pidfile.exists(), "the harness never started"
    pids = [int(p) for p in pidfile.read_text().split()]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    for pid in pids:
        assert not _alive(pid), f"harness process {pid} survived Ctrl-C"
    recs = [json.loads(x) for x in (tmp_path / "out" / "rollout" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(r["episode_id"] for r in recs) == ["add0.s0", "add1.s0"], err
    assert {r["status"] for r in recs} == {"interrupted"}
    assert not list((tmp_path / "out" / "rollout" / "work").iterdir()), "episode directories left behind"
    # The episode that had run is closed as discarded at the proxy, so reconstruction skips it.
    assert all(end["metadata"]["discard"] for end in end_server.ends.values())

    fix = fake_recipe(tmp_path, ["fix", "calc.py", "return a - b", "return a + b"], name="fix")
    res = cli(*base_args(tmp_path, fix, tasks, end_server.url))
    assert res.returncode == 0, res.stderr
    recs = [json.loads(x) for x in (tmp_path / "out" / "rollout" / "episodes.jsonl").read_text().splitlines()]
    assert sorted(r["episode_id"] for r in recs[2:]) == ["add0.s0.a1", "add1.s0.a1"]
    assert all(r["status"] == "done" and r["reward"] == 1.0 for r in recs[2:])
    res = cli(*base_args(tmp_path, fix, tasks, end_server.url))  # all finished: nothing to do
    assert res.returncode == 0 and len((tmp_path / "out" / "rollout" / "episodes.jsonl").read_text().splitlines()) == 4
