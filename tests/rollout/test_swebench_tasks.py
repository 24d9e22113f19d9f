"""Loading SWE-bench instances (harness_recipes/tasks/swebench/instances.py): JSONL, Parquet, a
datasets dataset on disk, filters, bad rows."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness_recipes.tasks.swebench.instances import load_instances, read_rows, validate
from harness_recipes.tasks.swebench.sources import build_repo
from harness_recipes.tasks.task_file import TaskError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "swebench"
MINI = DATA / "mini.jsonl"
IDS = [json.loads(line)["instance_id"] for line in MINI.read_text().splitlines()]


def rows() -> list[dict]:
    return [json.loads(line) for line in MINI.read_text().splitlines()]


def write_jsonl(tmp_path: Path, rs: list[dict]) -> Path:
    p = tmp_path / "inst.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rs))
    return p


def portable(r: dict) -> dict:
    # polar_source paths are relative to the instances file: make them absolute for copies elsewhere.
    src = dict(r["polar_source"])
    src["sdist"], src["bug_patch"] = str(DATA / src["sdist"]), str(DATA / src["bug_patch"])
    return {**r, "polar_source": src}


def test_mini_loads_as_tasks_with_their_repositories():
    tasks = load_instances(f"swebench:{MINI}")
    assert [t.swebench["instance_id"] for t in tasks] == IDS and len(IDS) == 3
    for t in tasks:
        assert t.git_repo is not None and t.git_commit == t.swebench["base_commit"]
        assert t.prompt == t.swebench["problem_statement"] and t.swebench["FAIL_TO_PASS"]
        assert t.swebench["log_parser"] == "parse_log_pytest" and ">>>>> Start Test Output" in t.swebench["eval_script"]


def test_instances_and_limit_filter():
    assert [t.swebench["instance_id"] for t in load_instances(MINI, instances=[IDS[2], IDS[0]])] == [IDS[0], IDS[2]]
    assert [t.swebench["instance_id"] for t in load_instances(MINI, limit=2)] == IDS[:2]
    with pytest.raises(TaskError, match="not in .*: nope"):
        load_instances(MINI, instances=["nope"])


def test_parquet_and_saved_dataset_give_the_same_tasks(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    rs = [portable(r) for r in rows()]
    # As published: the test lists JSON-encoded strings, polar_source a JSON object.
    flat = [{**r, "FAIL_TO_PASS": json.dumps(r["FAIL_TO_PASS"]), "PASS_TO_PASS": json.dumps(r["PASS_TO_PASS"])}
            for r in rs]
    pq.write_table(pa.Table.from_pylist(flat), tmp_path / "inst.parquet")
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "ds"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(flat)}).save_to_disk(str(tmp_path / "dsd"))
    want = [(t.id, t.git_commit, t.swebench["FAIL_TO_PASS"]) for t in load_instances(write_jsonl(tmp_path, rs))]
    for spec in ("inst.parquet", "ds", "dsd"):
        got = [(t.id, t.git_commit, t.swebench["FAIL_TO_PASS"]) for t in load_instances(f"swebench:{tmp_path / spec}")]
        assert got == want, spec


def test_a_directory_that_is_no_dataset_says_so(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(TaskError, match="not a dataset saved with save_to_disk"):
        read_rows(tmp_path / "d")


@pytest.mark.parametrize("field,value,message", [
    ("instance_id", None, "missing required field 'instance_id'"),
    ("repo", "six", "field 'repo' must be owner/name"),
    ("base_commit", "main", "field 'base_commit' must be a git commit sha"),
    ("FAIL_TO_PASS", "[not json", "field 'FAIL_TO_PASS' is a string but not a JSON list"),
    ("FAIL_TO_PASS", [], "field 'FAIL_TO_PASS' is empty"),
    ("PASS_TO_PASS", [1, 2], "field 'PASS_TO_PASS' must be a list of test names"),
    ("test_patch", "", "field 'test_patch' is empty"),
    ("version", None, "missing required field 'version'"),
    ("log_parser", "parse_log_nothing", "field 'log_parser' 'parse_log_nothing' is not a parser swebench knows"),
    ("test_cmd", 5, "field 'test_cmd' must be a string"),
])
def test_bad_row_names_the_row_and_the_field(tmp_path, field, value, message):
    rs = [portable(r) for r in rows()]
    if value is None:
        del rs[1][field]
        rs[1].pop("test_cmd", None)
    else:
        rs[1][field] = value
    p = write_jsonl(tmp_path, rs)
    with pytest.raises(TaskError, match=message) as exc:
        load_instances(f"swebench:{p}")
    assert f"{p}:2" in str(exc.value)


def test_a_changed_sdist_is_refused(tmp_path):
    r = portable(rows()[0])
    r["polar_source"]["sha256"] = "0" * 64
    with pytest.raises(TaskError, match="sha256 .* is not the recorded"):
        load_instances(write_jsonl(tmp_path, [r]))


def test_the_repository_build_is_deterministic(tmp_path):
    r = rows()[2]
    assert build_repo(r, DATA, tmp_path / "a") == build_repo(r, DATA, tmp_path / "b") == (
        r["environment_setup_commit"], r["base_commit"])


def test_eval_script_from_test_cmd_has_the_official_shape():
    r = validate({k: v for k, v in rows()[0].items() if k != "eval_script"}, "row")
    lines = r["eval_script"].splitlines()
    assert lines[:3] == ["#!/bin/bash", "set -uxo pipefail", "cd /testbed"]
    start, end = lines.index(": '>>>>> Start Test Output'"), lines.index(": '>>>>> End Test Output'")
    assert lines[start + 1:end] == [r["test_cmd"]]
    assert f"git checkout {r['base_commit']} test_six.py" in lines


def test_cli_refuses_filters_without_swebench_and_local_runtime(tmp_path):
    from click.testing import CliRunner

    from harness_recipes.cli import main
    common = ["--recipe", "pi", "--proxy", "http://127.0.0.1:9", "--logdir", str(tmp_path / "l"),
              "--out", str(tmp_path / "o")]
    res = CliRunner().invoke(main, ["run", "--tasks", str(ROOT / "data/tasks/tasks.jsonl"), "--limit", "1", *common])
    assert res.exit_code == 2 and "use them with --tasks swebench:FILE" in res.output
    res = CliRunner().invoke(main, ["run", "--tasks", f"swebench:{MINI}", "--limit", "1", *common])
    assert res.exit_code == 2 and "add --runtime docker" in res.output
    res = CliRunner().invoke(main, ["run", "--tasks", f"swebench:{MINI}", "--instances", "x,y", *common])
    assert res.exit_code == 2 and "not in" in res.output and "x, y" in res.output


def test_experiment_file_takes_swebench_tasks(tmp_path):
    from harness_recipes.fleet.experiment import load_experiment, plan
    paper = ROOT / "harness_recipes" / "fleet" / "experiments" / "polar-swebench-qwen3.5-4b.toml"
    text = paper.read_text()
    old = 'swebench = "/shared/swebench/verified.jsonl"  # princeton-nlp/SWE-bench_Verified as JSONL\n'
    assert old in text
    text = text.replace(old, f'tasks = "swebench:{MINI}"\n').replace('repos = "/shared/swebench/repos"', "")
    f = tmp_path / "exp.toml"
    f.write_text(text)
    exp = load_experiment(f)
    assert exp.rollout["_n_tasks"] == 3
    assert any(f"--tasks swebench:{MINI}" in line and "3 x 8 samples" not in line for line in plan(exp))
    assert any(line.startswith("tasks: 3 x 8 samples") for line in plan(exp))


def test_node_libraries_beyond_glibc_are_found_in_ldd_output():
    from harness_recipes.runtimes.docker import extra_libs
    static_ish = """\tlinux-vdso.so.1 (0x00007ffd)
\tlibdl.so.2 => /lib/x86_64-linux-gnu/libdl.so.2 (0x00007f)
\tlibstdc++.so.6 => /lib/x86_64-linux-gnu/libstdc++.so.6 (0x00007f)
\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f)
\t/lib64/ld-linux-x86-64.so.2 (0x00007f)"""
    assert extra_libs(static_ish) == {}
    debian = static_ish + "\n\tlibnode.so.108 => /lib/x86_64-linux-gnu/libnode.so.108 (0x00007f)\n" \
                          "\tlibuv.so.1 => /lib/x86_64-linux-gnu/libuv.so.1 (0x00007f)"
    assert extra_libs(debian) == {"libnode.so.108": "/lib/x86_64-linux-gnu/libnode.so.108",
                                  "libuv.so.1": "/lib/x86_64-linux-gnu/libuv.so.1"}


def test_the_mini_projects_file_is_what_mini_jsonl_was_made_from():
    """mini.py's data file gives back the rows' identities, sources, test commands and issues, and
    each project's test is the line the row's test_patch adds."""
    from harness_recipes.tasks.swebench.mini import PROJECTS_FILE, load_projects
    projects = load_projects(DATA / PROJECTS_FILE)
    assert [p["instance_id"] for p in projects] == IDS
    for p, r in zip(projects, rows()):
        assert (p["repo"], p["version"], p["test_cmd"], p["problem_statement"]) == \
            (r["repo"], r["version"], r["test_cmd"], r["problem_statement"])
        src = ("sdist", "url", "bug_patch")
        assert {k: p[k] for k in src} == {k: r["polar_source"][k] for k in src}
        assert (DATA / p["sdist"]).is_file() and (DATA / p["bug_patch"]).is_file()
        added = "\n".join(line[1:] for line in r["test_patch"].splitlines()
                          if line.startswith("+") and not line.startswith("+++"))
        assert p["test"].strip() in added


def test_a_mini_project_without_a_field_is_refused_by_name(tmp_path):
    from harness_recipes.tasks.swebench.mini import load_projects
    bad = tmp_path / "projects.toml"
    bad.write_text('[[project]]\ninstance_id = "a__b-c"\nrepo = "a/b"\n')
    with pytest.raises(SystemExit, match=r"project 1 \(a__b-c\) lacks \['bug', 'package'"):
        load_projects(bad)
