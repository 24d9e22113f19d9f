"""Imports run one way, every edge is seen, and no package code reaches outside its package.

polar_contracts is the base (log format, shard contract, control protocol, chat rendering rules,
translators); polar_recon, addon, polar_serve and trainer build on it and never on each other;
harness_recipes (polar-rollout, the fleet, the demo) orchestrates all of them. Nothing imports
tests. The edges are read from the source: every `import` statement (also those inside
functions), every `importlib.import_module("...")` with a constant name (relative ones resolved),
and every entry point declared in setup.cfg (a group's providers are edges of the package that
loads the group), so a back-edge fails here before it becomes a cycle at run time.
"""
from __future__ import annotations

import ast
import configparser
import importlib.util
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


def imported_modules(path: Path, root: Path = REPO, typing_only: bool = True) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; relative imports resolved.
    typing_only False: leave out the imports under ``if TYPE_CHECKING:`` (annotations, no run-time edge)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root).with_suffix("").parts
    skip = set() if typing_only else {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                                      for stmt in block.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = rel[: len(rel) - node.level]
                out.append((node.lineno, ".".join(base + ((node.module,) if node.module else ()))))
            else:
                out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and _called(node) == "import_module" and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            name = node.args[0].value
            if name.startswith("."):  # relative to the anchor, always the module's own __name__ here
                level = len(name) - len(name.lstrip("."))
                anchor = rel[:-1] if path.name == "__init__.py" else rel
                name = ".".join((*anchor[: len(anchor) - (level - 1)], name.lstrip(".")))
            out.append((node.lineno, name))
    return out


def _is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute)
                                                                      and t.attr == "TYPE_CHECKING")


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def entry_point_groups(setup_cfg: Path = REPO / "setup.cfg") -> dict[str, list[str]]:
    """group -> the modules its entry points name (setup.cfg [options.entry_points])."""
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    if not cfg.has_section("options.entry_points"):
        return {}
    groups = {}
    for group, value in cfg.items("options.entry_points"):
        groups[group] = [line.split("=", 1)[1].strip().split(":")[0] for line in value.splitlines() if "=" in line]
    return groups


def entry_point_edges(files: list[Path], groups: dict[str, list[str]], root: Path = REPO) -> list[tuple[Path, int, str]]:
    """(file, line, module): a file that loads an entry point group (entry_points(group="G") or
    .select(group="G")) depends on every module that group's entry points name."""
    out = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _called(node) in ("entry_points", "select"):
                for kw in node.keywords:
                    if kw.arg == "group" and isinstance(kw.value, ast.Constant):
                        out += [(path, node.lineno, mod) for mod in groups.get(kw.value.value, [])]
                    elif kw.arg == "group":
                        out.append((path, node.lineno, "<an entry point group this test cannot read>"))
    return out


def test_there_are_packages_to_check():
    files = package_files()
    assert {pkg for pkg, _ in files} == set(ALLOWED) and len(files) > 50


def back_edges(pkg: str, files: list[Path], root: Path, groups: dict[str, list[str]] | None = None) -> list[str]:
    bad = []
    edges = [(path, line, mod) for path in files for line, mod in imported_modules(path, root)]
    edges += [(p, line, mod) for p, line, mod in entry_point_edges(files, groups or {}, root)]
    for path, line, mod in edges:
        top = mod.split(".")[0]
        top = "polar_data" if top == "data" else top
        if mod.startswith("<") or (top in PROJECT and top != pkg and top not in ALLOWED[pkg]):
            bad.append(f"{path.relative_to(root)}:{line} imports {mod}")
    return bad


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_imports_run_one_way(pkg):
    bad = back_edges(pkg, [p for owner, p in package_files() if owner == pkg], REPO, entry_point_groups())
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
    (pkg / "lazy.py").write_text("import importlib\nfrom importlib.metadata import entry_points\n\n\n"
                                 "def f():\n    return importlib.import_module('trainer.grpo_trainer')\n\n\n"
                                 "def g():\n    return entry_points(group='polar.plugins')\n")
    files = sorted(pkg.rglob("*.py"))
    groups = {"polar.plugins": ["addon.translate", "polar_recon.own"]}
    assert back_edges("polar_recon", files, tmp_path, groups) == [
        "polar_recon/lazy.py:6 imports trainer.grpo_trainer", "polar_recon/m.py:6 imports addon.routing",
        "polar_recon/m.py:9 imports tests.support", "polar_recon/sub/n.py:1 imports trainer",
        "polar_recon/lazy.py:10 imports addon.translate"]
    assert [w for _, w in _reaches_outside(ast.parse((pkg / "m.py").read_text()))] == ["touches sys.path"]


def test_every_entry_point_names_a_module_that_exists():
    for group, mods in entry_point_groups().items():
        for mod in mods:
            assert importlib.util.find_spec(mod) is not None, f"setup.cfg entry point group {group}: no module {mod}"


def test_every_package_is_in_the_wheel():
    """A package directory setup.cfg does not list is left out of the wheel (and fails only there)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    listed = {line.strip() for line in cfg.get("options", "packages").splitlines() if line.strip()}
    found = {("polar_data" if d.parts[0] == "data" else ".".join(d.parts))
             for pkg, path in package_files() for d in [path.parent.relative_to(REPO)] if (path.parent / "__init__.py").exists()}
    assert found <= listed, f"package directories setup.cfg [options] packages does not list: {sorted(found - listed)}"
