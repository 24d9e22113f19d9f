"""Tasks for the rollout node: a JSONL file, one task per line.

    {"id": "fix-add", "workspace": "repos/fix_add", "prompt": "...", "eval": "python -m pytest -q",
     "timeout": 120, "eval_timeout": 60, "script": "scripts/fix_add.json"}

- ``workspace``: a directory copied into a fresh workspace per episode (relative to the JSONL
  file), or ``{"git": PATH, "commit": SHA}`` for a local git repository checked out at a commit.
- ``eval``: shell command run in the workspace after the harness. Its ``python -m unittest|pytest``
  on named test files runs through Polar's runner with canary tests, and the verdict requires the
  structured result, exit status and summary to agree (harness_recipes/verdict/command.py); any
  other command: exit status 0 -> reward 1.0, recorded as ``verdict: unchecked``.
- ``script``: optional, the polar-serve script that makes the scripted tiny model solve it.

SWE-bench-style instances (``instance_id``, ``repo``, ``base_commit``, ``problem_statement``,
``test_patch``, ``FAIL_TO_PASS``) load from a local file with `load_swebench`, given a directory of
local clones named ``owner__name``; nothing is downloaded.
"""
from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,100}$")


class TaskError(ValueError):
    pass


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    eval_cmd: str
    workspace_dir: Path | None = None  # directory copied per episode
    git_repo: Path | None = None  # or: local git repository ...
    git_commit: str | None = None  # ... checked out at this commit
    timeout: float = 300.0
    eval_timeout: float = 120.0
    setup_patch: str = ""  # applied after checkout (SWE-bench test_patch goes to eval instead)
    eval_patch: str = ""  # applied just before evaluation (tests the agent must not see)
    script: Path | None = None
    extra: dict = field(default_factory=dict)
    # A SWE-bench instance (harness_recipes/tasks/swebench/): graded by swebench, run in the instance's image under docker.
    swebench: dict | None = None


def _need(obj: dict, key: str, kind: type, where: str):
    if key not in obj:
        raise TaskError(f"{where}: missing required field {key!r}")
    if not isinstance(obj[key], kind):
        raise TaskError(f"{where}: field {key!r} must be {kind.__name__}")
    return obj[key]


def _positive(obj: dict, key: str, default: float, where: str) -> float:
    v = obj.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
        raise TaskError(f"{where}: {key!r} must be a positive number of seconds, got {v!r}")
    return float(v)


def parse_task(obj: dict, base: Path, where: str) -> Task:
    tid = _need(obj, "id", str, where)
    if not ID_RE.match(tid):
        raise TaskError(f"{where}: task id {tid!r} must match [A-Za-z0-9._-]{{1,100}} (it becomes part of episode ids)")
    ws = obj.get("workspace")
    workspace_dir = git_repo = git_commit = None
    if isinstance(ws, str):
        workspace_dir = (base / ws).resolve()
        if not workspace_dir.is_dir():
            raise TaskError(f"{where}: workspace directory {workspace_dir} does not exist")
    elif isinstance(ws, dict):
        git_repo = (base / _need(ws, "git", str, f"{where}.workspace")).resolve()
        git_commit = _need(ws, "commit", str, f"{where}.workspace")
        if not (git_repo / ".git").exists() and not (git_repo / "HEAD").exists():
            raise TaskError(f"{where}: {git_repo} is not a git repository")
    elif ws is not None:
        raise TaskError(f"{where}: 'workspace' must be a directory path or {{\"git\": PATH, \"commit\": SHA}}")
    script = obj.get("script")
    if script is not None:
        script = (base / script).resolve()
        if not script.is_file():
            raise TaskError(f"{where}: script file {script} does not exist")
    return Task(
        id=tid,
        prompt=_need(obj, "prompt", str, where),
        eval_cmd=_need(obj, "eval", str, where),
        workspace_dir=workspace_dir,
        git_repo=git_repo,
        git_commit=git_commit,
        timeout=_positive(obj, "timeout", 300, where),
        eval_timeout=_positive(obj, "eval_timeout", 120, where),
        setup_patch=obj.get("setup_patch", ""),
        eval_patch=obj.get("eval_patch", ""),
        script=script,
        extra={k: v for k, v in obj.items() if k not in {"id", "prompt", "eval", "workspace", "timeout",
                                                          "eval_timeout", "setup_patch", "eval_patch", "script"}},
    )


def _jsonl(path: Path) -> list[tuple[str, dict]]:
    if not path.is_file():
        raise TaskError(f"task file not found: {path}")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}: not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise TaskError(f"{where}: each line must be a JSON object")
        rows.append((where, obj))
    return rows


def load_tasks(path: str | Path) -> list[Task]:
    path = Path(path)
    tasks = [parse_task(obj, path.parent, where) for where, obj in _jsonl(path)]
    if not tasks:
        raise TaskError(f"{path}: no tasks")
    seen: set[str] = set()
    for t in tasks:
        if t.id in seen:
            raise TaskError(f"{path}: duplicate task id {t.id!r}")
        seen.add(t.id)
    return tasks


def _swebench_tests(value) -> list[str]:
    # The field is a JSON-encoded list in the published files, a plain list in some exports.
    return json.loads(value) if isinstance(value, str) else list(value or [])


def load_swebench(path: str | Path, repos_dir: str | Path, timeout: float = 1800) -> list[Task]:
    """SWE-bench-style instances from a local JSONL file, checked out from local clones."""
    path, repos_dir = Path(path), Path(repos_dir)
    tasks = []
    for where, obj in _jsonl(path):
        iid = _need(obj, "instance_id", str, where)
        repo = repos_dir / _need(obj, "repo", str, where).replace("/", "__")
        tests = _swebench_tests(obj.get("FAIL_TO_PASS")) + _swebench_tests(obj.get("PASS_TO_PASS"))
        task = {
            "id": re.sub(r"[^A-Za-z0-9._-]", "_", iid)[:100],
            "prompt": _need(obj, "problem_statement", str, where),
            "workspace": {"git": str(repo.resolve()), "commit": _need(obj, "base_commit", str, where)},
            "eval": "python -m pytest -q " + " ".join(shlex.quote(t) for t in tests),
            "timeout": timeout,
            "eval_patch": obj.get("test_patch", ""),
        }
        tasks.append(parse_task(task, path.parent, where))
    return tasks
