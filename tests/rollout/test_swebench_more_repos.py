"""SWE-bench Verified rows of repositories other than flask, as published, in images built here.

The rows are those of data/swebench-verified/SWE-bench_Verified-test.parquet, unchanged; their
repositories are bare ones in data/swebench-verified/repos (base_commit at depth 2: its PROVENANCE.md).
CI runs CI_ROW end to end on docker (Python 3.9 from Debian bullseye, its conda package list from
PyPI, its own log parser): the gold patch resolves it, no change does not. The other rows of the
parity table run in bench/bench_swebench_parity.py (minutes each).
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from harness_recipes.tasks.swebench.instances import load_instances

from .test_swebench_docker import run

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "swebench-verified"
VERIFIED = DATA / "SWE-bench_Verified-test.parquet"
REPOS = DATA / "repos"
# row -> its repository in REPOS (what make-repos.sh wrote, PROVENANCE.md)
ROWS = {"psf__requests-5414": "psf__requests", "pytest-dev__pytest-7432": "pytest-dev__pytest",
        "sympy__sympy-12481": "sympy__sympy", "pylint-dev__pylint-4970": "pylint-dev__pylint",
        "sphinx-doc__sphinx-8721": "sphinx-doc__sphinx", "mwaskom__seaborn-3069": "mwaskom__seaborn"}
CI_ROW = "sympy__sympy-12481"  # sympy's bin/test and parse_log_sympy, about a minute of tests


def git(repo: Path, *args: str) -> list[str]:
    p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()


def test_each_repository_holds_its_rows_base_commit_and_nothing_later():
    tasks = {t.swebench["instance_id"]: t for t in load_instances(f"swebench:{VERIFIED}", repos=REPOS,
                                                                     instances=list(ROWS))}
    for iid, name in ROWS.items():
        repo = REPOS / name
        base = tasks[iid].swebench["base_commit"]
        assert tasks[iid].git_repo == repo.resolve(), iid
        every = set(git(repo, "rev-list", "--all"))
        assert base in every and every == set(git(repo, "rev-list", base)), f"{name}: a commit after {base}"
        assert (repo / "shallow").is_file(), f"{name}: expected the shallow repository of PROVENANCE.md"


def _episode(tmp_path, monkeypatch, end_server, rt_cls, task, argv, files=()):
    prefix = tmp_path / "cache" / "fake"  # the fake harness's prefix: the only part of the cache a sandbox sees
    prefix.mkdir(parents=True, exist_ok=True)
    for name, text in files:
        (prefix / name).write_text(text)
    recs, records = run(tmp_path, monkeypatch, end_server, rt_cls, argv, [task])
    (rec,) = recs.values()
    return rec, records


def _ci_task():
    (t,) = load_instances(f"swebench:{VERIFIED}", repos=REPOS, instances=[CI_ROW])
    assert t.swebench["log_parser"] == "parse_log_sympy" and t.swebench["version"] == "1.0"
    return t


def test_gold_resolves_a_sympy_row_on_python_39(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    t = _ci_task()
    rec, records = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls, t,
                            ["apply", str(tmp_path / "cache" / "fake" / "gold.patch")],
                            [("gold.patch", t.swebench["patch"])])
    sb = rec["swebench"]
    assert rec["status"] == "done" and rec["reward"] == 1.0 and sb["resolved"] is True, rec
    assert sb["image_path"] == "built" and sb["image"].startswith("polar-sweb.eval.sympy_1776_sympy-12481:")
    assert sb["tests"]["FAIL_TO_PASS"]["failure"] == [] and sb["tests"]["PASS_TO_PASS"]["failure"] == []
    log = (records.episode_dir(rec["episode_id"]) / "test_output.txt").read_text()
    # sympy's own runner, in the venv of Debian bullseye's Python 3.9
    assert "+ source /opt/polar/testbed-env/bin/activate" in log and "+ bin/test -C --verbose sympy/" in log
    assert "executable:         /opt/polar/testbed-env/bin/python  (3.9.2-final-0) [CPython]" in log


def test_no_change_leaves_the_sympy_row_unresolved(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    t = _ci_task()
    rec, _ = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls, t, ["noop"])
    sb = rec["swebench"]
    assert rec["status"] == "done" and rec["reward"] == 0.0 and sb["resolved"] is False, rec
    assert sb["tests"]["FAIL_TO_PASS"]["failure"], sb["tests"]
    assert end_server.ends[rec["episode_id"]]["metadata"]["discard"] is False  # kept: the model's failure
