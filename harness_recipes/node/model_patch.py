"""The model's patch: the pristine tree vs the agent's tree, less what the agent may not change.

Both trees are read by the node (runtimes/file_tree.py), never through the agent's git. The
agent may change the code; it may not change how the code is tested. A change to a file that
configures or runs the test runner is reverted (the path keeps its pristine content, or stays
absent) and its path recorded in `stripped`:

- `conftest.py` anywhere, and the files pytest reads its configuration from (`pytest.ini`,
  `.pytest.ini`, `tox.ini`, `setup.cfg`, `pyproject.toml`): a conftest hook, or an `addopts = -p
  plugin`, makes every test pass. These files can hold other things; a hunk-level split is not
  attempted (honest and simple: the whole file's change goes);
- Python start-up hooks: `sitecustomize.py`, `usercustomize.py`, `*.pth`;
- compiled bytecode (`__pycache__/`, `*.pyc`, `*.pyo`): an unchecked hash-based .pyc is imported
  instead of its source, whatever the source says;
- modules that shadow the test runner at the repository root (`pytest.py`, `pytest/`, `_pytest/`,
  `pluggy/`, `py.py`, `iniconfig/`): `python -m pytest` puts the working directory first on sys.path;
- modules that shadow the standard library at the repository root (`unittest/`, `json.py`, ...):
  `python -m unittest` imports the working directory's `unittest` first, and a toy task's eval
  command runs exactly that;
- every file the task's test patch touches (the eval script resets them anyway; stripped here so
  the record says so).

The official SWE-bench harness applies the whole prediction; Polar strips these (docs/security.md).

The patch has a budget (the store's file_tree.Budget): more changed paths than max_patch_files, or a
patch over max_patch_bytes, raises OverBudget, which grading turns into a 0 with that reason.
"""
from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field

from harness_recipes.runtimes.file_tree import ObjectStore, OverBudget, Snapshot

RUNNER_CONFIG = {"conftest.py", "pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml"}
STARTUP_HOOKS = {"sitecustomize.py", "usercustomize.py"}
RUNNER_MODULES = {"pytest.py", "pytest", "_pytest", "pluggy", "py.py", "iniconfig"}
_DIFF_PATH = re.compile(r"^(?:diff --git a/(\S+) b/(\S+)|--- a/(\S+)|\+\+\+ b/(\S+))$", re.M)


def patch_paths(patch: str) -> set[str]:
    """The paths a unified diff touches (both sides of each file header)."""
    return {p for m in _DIFF_PATH.finditer(patch or "") for p in m.groups() if p}


def protected(path: str, test_paths: set[str] = frozenset()) -> str:
    """Why the agent may not change ``path`` ('' when it may)."""
    parts = path.split("/")
    name = parts[-1]
    if path in test_paths:
        return "a file of the task's test patch"
    if name in RUNNER_CONFIG:
        return "test runner configuration"
    if name in STARTUP_HOOKS or name.endswith(".pth"):
        return "Python start-up hook"
    if "__pycache__" in parts or name.endswith((".pyc", ".pyo")):
        return "compiled bytecode"
    if parts[0] in RUNNER_MODULES:
        return "shadows the test runner"
    if (parts[0][:-3] if parts[0].endswith(".py") else parts[0]) in sys.stdlib_module_names:
        return "shadows a standard-library module"
    return ""


@dataclass
class ModelPatch:
    patch: bytes
    changed: list[str]  # every path the agent changed (stripped ones included)
    stripped: list[str]  # changed paths reverted by the rule above
    dropped: list[tuple[str, str]] = field(default_factory=list)  # left out of the agent's tree (file_tree.py)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.patch).hexdigest()

    def metadata(self) -> dict:
        # Bytecode is written by any test run: counted, not listed, so the list shows what matters.
        bytecode = [p for p in self.stripped if protected(p) == "compiled bytecode"]
        stripped = [p for p in self.stripped if p not in bytecode]
        dropped = [f"{p}: {why}" for p, why in self.dropped]
        # The lists are the agent's to lengthen (ten thousand fifos): the end record must stay under the
        # control body bound, or the episode could not end and would be discarded. Counted in full.
        return {"patch_sha256": self.sha256, "patch_bytes": len(self.patch),
                "stripped_paths": _brief(stripped), "stripped_bytecode": len(bytecode),
                "dropped_paths": _brief(dropped),
                **({"stripped_count": len(stripped)} if len(stripped) > LISTED else {}),
                **({"dropped_count": len(dropped)} if len(dropped) > LISTED else {})}


LISTED = 50  # entries of each list in the eval metadata (each at most 300 characters)


def _brief(items: list[str]) -> list[str]:
    return [i[:300] for i in items[:LISTED]]


def model_patch(store: ObjectStore, pristine: Snapshot, agent: Snapshot, test_paths: set[str] = frozenset()) -> ModelPatch:
    a, b = pristine.entries, agent.entries
    changed = sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))
    stripped = [p for p in changed if protected(p, test_paths)]
    budget = store.budget
    if len(changed) - len(stripped) > budget.max_patch_files:
        raise OverBudget(f"the patch changes {len(changed) - len(stripped)} paths, over the budget of "
                         f"{budget.max_patch_files} (max_patch_files)")
    kept = dict(b)
    for p in stripped:
        if p in a:
            kept[p] = a[p]
        else:
            kept.pop(p, None)
    patch = store.diff(store.tree(a), store.tree(kept))
    if len(patch) > budget.max_patch_bytes:
        raise OverBudget(f"the patch is {len(patch)} bytes, over the budget of {budget.max_patch_bytes} "
                         "(max_patch_bytes)")
    return ModelPatch(patch=patch, changed=changed, stripped=stripped, dropped=list(agent.dropped))
