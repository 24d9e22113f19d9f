import json
import subprocess
from pathlib import Path

import pytest

from harness_recipes.runtimes.base import populate_workspace
from harness_recipes.tasks.task_file import TaskError, load_swebench, load_tasks

ROOT = Path(__file__).resolve().parents[2]


def test_sample_tasks_load_and_each_fails_before_the_fix(tmp_path):
    tasks = load_tasks(ROOT / "data" / "tasks" / "tasks.jsonl")
    assert len(tasks) >= 3 and all(t.script and t.script.is_file() for t in tasks)
    for t in tasks:
        ws = tmp_path / t.id
        populate_workspace(t, ws)
        res = subprocess.run(["bash", "-c", t.eval_cmd], cwd=ws, capture_output=True)
        assert res.returncode != 0, f"{t.id}: its test passes before any fix"


def test_the_scripted_fixes_make_the_tests_pass(tmp_path):
    # The commands the scripted server sends must really fix each task (the script has a rule per task).
    script = json.loads((ROOT / "data" / "tasks" / "scripts" / "fix_tasks.json").read_text())
    for t in load_tasks(ROOT / "data" / "tasks" / "tasks.jsonl"):
        ws = tmp_path / t.id
        populate_workspace(t, ws)
        (rule,) = [r for r in script["rules"]
                   if r["when"].get("turn") == 0 and r["when"].get("last_user_contains", "\0") in t.prompt]
        subprocess.run(["bash", "-c", rule["reply"]["tool_calls"][0]["arguments"]["command"]], cwd=ws, check=True)
        assert subprocess.run(["bash", "-c", t.eval_cmd], cwd=ws, capture_output=True).returncode == 0, t.id


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "p", "eval": "true"}', "missing required field 'id'"),
    ('{"id": "x", "prompt": "p", "eval": "true", "timeout": -1}', "'timeout' must be a positive number"),
    ('{"id": "x", "prompt": "p", "eval": "true", "workspace": "nope"}', "workspace directory .* does not exist"),
    ('{"id": "x/y", "prompt": "p", "eval": "true"}', "must match"),
    ('not json', "not valid JSON"),
    ('[1]', "must be a JSON object"),
])
def test_bad_task_lines_are_named(tmp_path, line, message):
    p = tmp_path / "t.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(TaskError, match=message):
        load_tasks(p)


def test_duplicate_ids_and_empty_file(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"id": "a", "prompt": "p", "eval": "true"}\n' * 2)
    with pytest.raises(TaskError, match="duplicate task id 'a'"):
        load_tasks(p)
    p.write_text("\n")
    with pytest.raises(TaskError, match="no tasks"):
        load_tasks(p)


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True)


def test_swebench_instances_from_a_local_clone(tmp_path):
    repo = tmp_path / "repos" / "acme__calc"
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    base = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    (repo / "calc.py").write_text("def add(a, b):\n    return a * b\n")
    _git(repo, "commit", "-qam", "later")
    test_patch = ("diff --git a/test_calc.py b/test_calc.py\nnew file mode 100644\n--- /dev/null\n+++ b/test_calc.py\n"
                  "@@ -0,0 +1,3 @@\n+from calc import add\n+def test_add():\n+    assert add(2, 3) == 5\n")
    inst = {"instance_id": "acme__calc-1", "repo": "acme/calc", "base_commit": base, "problem_statement": "add is wrong",
            "test_patch": test_patch, "FAIL_TO_PASS": json.dumps(["test_calc.py::test_add"]), "PASS_TO_PASS": "[]"}
    f = tmp_path / "swe.jsonl"
    f.write_text(json.dumps(inst) + "\n")
    (task,) = load_swebench(f, tmp_path / "repos")
    assert task.id == "acme__calc-1" and task.git_commit == base and "test_calc.py::test_add" in task.eval_cmd
    ws = tmp_path / "ws"
    populate_workspace(task, ws)
    assert "a - b" in (ws / "calc.py").read_text()  # checked out at base_commit, not the newer one
    assert not (ws / "test_calc.py").exists()  # the test patch is for evaluation only


def test_swebench_missing_clone_is_named(tmp_path):
    f = tmp_path / "swe.jsonl"
    f.write_text(json.dumps({"instance_id": "a-1", "repo": "o/r", "base_commit": "abc", "problem_statement": "p"}) + "\n")
    with pytest.raises(TaskError, match="is not a git repository"):
        load_swebench(f, tmp_path)


def test_sample_task_file_is_the_first_bundled_task_under_its_own_id(tmp_path):
    from harness_recipes.tasks.samples import TASKS, sample_task_file
    path = sample_task_file(tmp_path, "pi")
    again = sample_task_file(tmp_path, "codex", prompt="say hi")
    (task,) = load_tasks(path)
    (other,) = load_tasks(again)
    first = json.loads((TASKS / "tasks.jsonl").read_text().splitlines()[0])
    assert (path.name, task.id, other.id) == ("tasks-pi.jsonl", "fix-add-pi", "fix-add-codex")
    assert task.prompt == first["prompt"] and other.prompt == "say hi"
    # written elsewhere, it still names the bundled workspace and script
    assert json.loads(path.read_text())["workspace"] == str(TASKS / first["workspace"])
