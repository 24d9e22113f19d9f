"""The bundled sample tasks (data/tasks/, installed as polar_data), as task files a run can be given.

`sample_task_file(where, tag)` writes the first sample task (fix `add`, scripted by
scripts/fix_tasks.json) under its own id ``fix-add-<tag>``: runs that share one proxy log directory
(one per harness in the compat matrix and the end-to-end tests) then get their own episode ids and
GRPO groups. Its workspace and script paths are made absolute, since the file is written elsewhere.
"""
from __future__ import annotations

import json
from pathlib import Path

from polar_contracts.assets import data_path

TASKS = data_path("tasks")
SCRIPT = TASKS / "scripts" / "fix_tasks.json"


def sample_task_file(where: Path, tag: str, **fields) -> Path:
    """where/tasks-<tag>.jsonl: the first bundled task, id fix-add-<tag>, `fields` set over it."""
    task = json.loads((TASKS / "tasks.jsonl").read_text().splitlines()[0])
    task.update({"id": f"fix-add-{tag}", "workspace": str(TASKS / task["workspace"]),
                 "script": str(TASKS / task["script"]), **fields})
    path = Path(where) / f"tasks-{tag}.jsonl"
    path.write_text(json.dumps(task) + "\n")
    return path
