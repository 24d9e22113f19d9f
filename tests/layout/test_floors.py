"""The floors inside harness_recipes: each part imports only its own modules and the floors below it.

A part is a subpackage of harness_recipes (``tasks``, ``node``, ...) or one of its top modules
(``cache``, ``cli``, ...). Parts on one floor do not import each other. ``tasks.task_file`` (what a
task is) is a leaf: it imports nothing of harness_recipes, so every floor can name a Task. Imports
under ``if TYPE_CHECKING:`` are annotations, not run-time edges, and are not counted. Edges are
read as test_imports.py reads them (inside functions, importlib.import_module with a constant).
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.layout.test_imports import REPO, imported_modules

PACKAGE = "harness_recipes"
# lowest first
FLOORS: list[set[str]] = [
    {"cache", "docker_engine", "execution"},  # where things are cached; the local docker engine; what grading needs of a sandbox
    {"verdict"},  # the verdict the code under test cannot write (canaries, structured results)
    {"recipes", "tasks"},  # harness recipes; tasks, SWE-bench instances, their images and grading
    {"runtimes"},  # where an episode runs: it runs what the task resolved
    # one rollout node: scheduler, episodes, proxies, the local capture stack; the long-episode script
    {"node", "long_episode"},
    {"fleet", "attacks", "compat"},  # the Ray fleet; the sandbox attack suite; the compat matrix
    {"demo"},  # `make demo`, the closed loop, scripted replies on the real vLLM
    {"cli"},  # polar-rollout
]
LEAVES = {"tasks.task_file"}  # modules that import nothing of harness_recipes


def part_of(module: str) -> str | None:
    """'tasks' for harness_recipes.tasks.swebench.grade, None outside harness_recipes or for the package itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == PACKAGE and len(parts) > 1 else None


def floor_of(part: str) -> int:
    for i, parts in enumerate(FLOORS):
        if part in parts:
            return i
    raise KeyError(part)


def floor_violations(edges: list[tuple[str, str, int, str]]) -> list[str]:
    """edges: (importing module, its file for the message, line, imported module) -> what breaks the floors."""
    bad = []
    for module, where, line, target in edges:
        src, dst = part_of(module), part_of(target)
        if dst is None:
            continue
        if module.removeprefix(PACKAGE + ".") in LEAVES:
            bad.append(f"{where}:{line} imports {target}: {module} is a leaf")
        elif src is None or src == dst:
            continue
        elif src not in set().union(*FLOORS) or dst not in set().union(*FLOORS):
            bad.append(f"{where}:{line} imports {target}: {src if src not in set().union(*FLOORS) else dst} "
                       "is on no floor (add it to FLOORS)")
        elif floor_of(dst) >= floor_of(src):
            bad.append(f"{where}:{line} imports {target}: {src} (floor {floor_of(src)}) may import only floors "
                       f"below it, not {dst} (floor {floor_of(dst)})")
    return bad


def package_edges(root: Path) -> list[tuple[str, str, int, str]]:
    out = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        tree = None
        for line, mod in imported_modules(path, root):
            if mod != PACKAGE:
                out.append((module, str(rel), line, mod))
                continue
            # `from harness_recipes import demo` names the part in the imported name, not the module
            tree = tree or ast.parse(path.read_text(), str(path))
            names = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.lineno == line
                     for a in n.names]
            out += [(module, str(rel), line, f"{PACKAGE}.{name}") for name in names] or [(module, str(rel), line, mod)]
    return out


def test_every_part_is_on_a_floor():
    parts = {p.stem if p.is_file() else p.name for p in (REPO / PACKAGE).iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file()}
    named = set().union(*FLOORS)
    assert parts == named, f"parts of {PACKAGE} on no floor / floors naming no part: {sorted(parts ^ named)}"


def test_harness_recipes_floors():
    edges = package_edges(REPO)
    assert any(part_of(m) == "runtimes" and part_of(t) == "tasks" for m, _, _, t in edges)  # the reader sees edges
    bad = floor_violations(edges)
    assert not bad, "harness_recipes floors, lowest first: " + " < ".join("/".join(sorted(f)) for f in FLOORS) \
        + "\n" + "\n".join(bad)


def test_the_floor_checker_fails_on_a_planted_upward_import(tmp_path):
    """A copy of harness_recipes with bad imports planted: a runtime importing the node, a node module
    importing the demo (inside a function, relatively), task_file importing the cache, and a fleet
    module importing compat (same floor) are all reported, and so is an upward import under TYPE_CHECKING
    (an annotation still ties the lower floor to the higher one: grading code takes execution.Commands)."""
    pkg = tmp_path / PACKAGE
    for rel in ("runtimes", "node", "tasks", "fleet", "demo", "compat"):
        (pkg / rel).mkdir(parents=True)
        (pkg / rel / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "runtimes" / "bad.py").write_text("from harness_recipes.node.scheduler import Pipeline\n"
                                              "from harness_recipes.tasks.task_file import Task\n")
    (pkg / "node" / "bad.py").write_text("def f():\n    from ..demo import forced_replies\n")
    (pkg / "tasks" / "task_file.py").write_text("import json\nfrom harness_recipes import cache\n")
    (pkg / "tasks" / "grade.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                            "    from harness_recipes.runtimes.base import Sandbox\n")
    (pkg / "fleet" / "bad.py").write_text("import harness_recipes.compat\n")
    floor = {part: i for i, parts in enumerate(FLOORS) for part in parts}
    assert floor_violations(package_edges(tmp_path)) == [
        f"harness_recipes/fleet/bad.py:1 imports harness_recipes.compat: fleet (floor {floor['fleet']}) may import "
        f"only floors below it, not compat (floor {floor['compat']})",
        f"harness_recipes/node/bad.py:2 imports harness_recipes.demo: node (floor {floor['node']}) may import only "
        f"floors below it, not demo (floor {floor['demo']})",
        f"harness_recipes/runtimes/bad.py:1 imports harness_recipes.node.scheduler: runtimes (floor {floor['runtimes']}) "
        f"may import only floors below it, not node (floor {floor['node']})",
        f"harness_recipes/tasks/grade.py:4 imports harness_recipes.runtimes.base: tasks (floor {floor['tasks']}) may "
        f"import only floors below it, not runtimes (floor {floor['runtimes']})",
        "harness_recipes/tasks/task_file.py:2 imports harness_recipes.cache: harness_recipes.tasks.task_file is a leaf",
    ]
