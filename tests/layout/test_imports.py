"""Imports run one way, and no package code reaches outside its package.

polar_recon is the base (log format, shard contract, chat rendering rules, bundled data); addon,
polar_serve and trainer build on it; harness_recipes (polar-rollout, the demo, the closed loop)
orchestrates all of them. Nothing imports tests. The imports are read from the source (every
`import` statement, also those inside functions), so a back-edge fails here before it becomes a
cycle at run time.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# package -> the project packages it may import (besides itself)
ALLOWED = {
    "polar_data": set(),
    "polar_contracts": {"polar_data"},
    "polar_recon": {"polar_contracts", "polar_data"},
    "addon": {"polar_contracts"},
    "polar_serve": {"polar_contracts", "polar_data"},
    "trainer": {"polar_contracts", "polar_data"},
    "harness_recipes": {"polar_contracts", "polar_recon", "polar_data", "addon", "polar_serve", "trainer"},
}
PACKAGE_DIRS = {"polar_data": "data", **{p: p for p in ALLOWED if p != "polar_data"}}
PROJECT = set(ALLOWED) | {"tests", "bench", "data"}


def package_files() -> list[tuple[str, Path]]:
    return [(pkg, p) for pkg, d in PACKAGE_DIRS.items() for p in sorted((REPO / d).rglob("*.py"))]


def imported_modules(path: Path, root: Path = REPO) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root).with_suffix("").parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = rel[: len(rel) - node.level]
                out.append((node.lineno, ".".join(base + ((node.module,) if node.module else ()))))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def test_there_are_packages_to_check():
    files = package_files()
    assert {pkg for pkg, _ in files} == set(ALLOWED) and len(files) > 50


def back_edges(pkg: str, files: list[Path], root: Path) -> list[str]:
    bad = []
    for path in files:
        for line, mod in imported_modules(path, root):
            top = mod.split(".")[0]
            top = "polar_data" if top == "data" else top
            if top in PROJECT and top != pkg and top not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(root)}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_imports_run_one_way(pkg):
    bad = back_edges(pkg, [p for owner, p in package_files() if owner == pkg], REPO)
    assert not bad, f"{pkg} may import only {sorted(ALLOWED[pkg]) or 'no project package'}:\n" + "\n".join(bad)


def test_bench_does_not_import_tests():
    bad = [f"{p.relative_to(REPO)}:{line} imports {mod}" for p in sorted((REPO / "bench").rglob("*.py"))
           for line, mod in imported_modules(p) if mod.split(".")[0] == "tests"]
    assert not bad, "\n".join(bad)


def _reaches_outside(tree: ast.AST) -> list[tuple[int, str]]:
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
                and node.value.id == "sys":
            hits.append((node.lineno, "touches sys.path"))
        if isinstance(node, ast.Name) and node.id == "__file__":
            hits.append((node.lineno, "locates files from __file__ (use importlib.resources / polar_contracts.assets)"))
    return hits


def test_no_package_code_touches_sys_path_or_walks_up_from_its_file():
    bad = [f"{p.relative_to(REPO)}:{line} {what}" for _, p in package_files()
           for line, what in _reaches_outside(ast.parse(p.read_text()))]
    assert not bad, "\n".join(bad)


def test_bench_does_not_touch_sys_path():
    bad = [f"{p.relative_to(REPO)}:{line} {what}" for p in sorted((REPO / "bench").rglob("*.py"))
           for line, what in _reaches_outside(ast.parse(p.read_text())) if what == "touches sys.path"]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_back_edges(tmp_path):
    """The rules above can fail: a base module importing the addon (absolutely, relatively, inside
    a function) or tests, and a sys.path patch, are all reported."""
    pkg = tmp_path / "polar_recon"
    pkg.mkdir()
    (pkg / "m.py").write_text("import os\nfrom . import logschema\n\n\ndef f():\n    from addon.routing import route\n"
                              "    import sys\n    sys.path.insert(0, '.')\n    import tests.support\n")
    (pkg / "sub").mkdir()
    (pkg / "sub" / "n.py").write_text("from ...trainer import grpo\n")
    files = sorted(pkg.rglob("*.py"))
    assert back_edges("polar_recon", files, tmp_path) == [
        "polar_recon/m.py:6 imports addon.routing", "polar_recon/m.py:9 imports tests.support",
        "polar_recon/sub/n.py:1 imports trainer"]
    assert [w for _, w in _reaches_outside(ast.parse(files[0].read_text()))] == ["touches sys.path"]
