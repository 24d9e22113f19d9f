"""polar-rollout run as the docs write it: relative --out / --logdir (relative to where the command
runs), the open-proxy advice's commands, `polar-rollout secret`, what a piped run prints."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

from harness_recipes.node.progress import make_console, shown_changes
from harness_recipes.node.proxy_control import HOW_TO_SECURE
from polar_contracts.control import read_secret_file

from .conftest import fake_recipe, write_tasks

ROOT = Path(__file__).resolve().parents[2]


def rollout(cwd: Path, *args, timeout=180):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "harness_recipes.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_relative_out_and_logdir_are_relative_to_where_the_command_runs(tmp_path, end_server):
    """Grading used to fail every episode with FileNotFoundError under objects.git (its git ran in
    another directory than the relative --out named)."""
    fix = fake_recipe(tmp_path, ["fix", "calc.py", "return a - b", "return a + b"], name="fix")
    tasks = write_tasks(tmp_path)
    here = tmp_path / "here"
    here.mkdir()
    res = rollout(here, "run", "--recipe", fix, "--tasks", tasks, "--proxy", end_server.url, "--logdir", "logs",
                  "--out", "out", "--no-progress", "--recon", "none", "--isolation", "none", "--unsafe-open-proxy")
    assert res.returncode == 0, res.stdout + res.stderr
    (rec,) = [json.loads(x) for x in (here / "out" / "rollout" / "episodes.jsonl").read_text().splitlines()]
    assert rec["status"] == "done" and rec["reward"] == 1.0 and "error" not in rec, rec
    assert (here / "logs").is_dir() and not (ROOT / "out").exists()


def test_the_open_proxy_advice_runs_as_written_and_twice(tmp_path):
    """Every command HOW_TO_SECURE gives works in the directory the user is in, run twice."""
    (line,) = [x.strip() for x in HOW_TO_SECURE.splitlines() if x.strip().startswith("polar-rollout secret")]
    file = line.split()[-1]
    assert f"polar_control_secret_file={file}" in HOW_TO_SECURE and f"--control-secret-file {file}" in HOW_TO_SECURE
    first = rollout(tmp_path, *line.split()[1:])
    assert first.returncode == 0, first.stderr
    secret = read_secret_file(tmp_path / file)
    assert stat.S_IMODE((tmp_path / file).stat().st_mode) == 0o600
    again = rollout(tmp_path, *line.split()[1:])
    assert again.returncode == 0 and "already holds a control secret, kept" in again.stdout, again.stderr
    assert read_secret_file(tmp_path / file) == secret and "Traceback" not in again.stderr


def test_secret_refuses_what_it_cannot_keep(tmp_path):
    res = rollout(tmp_path, "secret", "no-such-dir/secret")
    assert res.returncode == 1 and "no-such-dir: no such directory" in res.stderr and "Traceback" not in res.stderr
    (tmp_path / "loose").write_text("x" * 40)
    (tmp_path / "loose").chmod(0o644)
    res = rollout(tmp_path, "secret", "loose")
    assert res.returncode == 1 and "mode 0644" in res.stderr and "not overwritten" in res.stderr
    assert (tmp_path / "loose").read_text() == "x" * 40


def test_piped_tables_are_not_cut_to_80_columns(tmp_path, end_server):
    fix = fake_recipe(tmp_path, ["fix", "calc.py", "return a - b", "return a + b"], name="fix")
    res = rollout(tmp_path, "run", "--recipe", fix, "--tasks", write_tasks(tmp_path), "--proxy", end_server.url,
                  "--logdir", "logs", "--out", "out", "--recon", "none", "--isolation", "none",
                  "--unsafe-open-proxy")
    assert res.returncode == 0, res.stderr
    header = next(x for x in res.stderr.splitlines() if "queued" in x)
    for col in ("prewarm", "finished", "reward (mean)", "episodes/s", "run-slot use"):
        assert col in header, res.stderr  # one line, not wrapped into 80 columns
    assert not make_console().is_terminal and make_console().width > 80


def test_changed_files_shown_without_bytecode():
    files = ["calc.py", "__pycache__/calc.cpython-311.pyc", "pkg/__pycache__/x.pyc", "old.pyc", "b/c.py"]
    assert shown_changes(files) == ["calc.py", "b/c.py"]


def test_eval_concurrency_has_help():
    for cmd in ("run", "fleet"):
        res = rollout(ROOT, cmd, "--help")
        block = res.stdout.split("--eval-concurrency", 1)[1].split("\n  --", 1)[0]
        assert "evaluations" in block, res.stdout
