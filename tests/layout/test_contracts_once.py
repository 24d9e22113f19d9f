"""Each contract is defined once: no column list, value set, protocol path or header name is
spelled out in two places of the product's code (a second copy drifts; import the first).

Read from the source: every assignment whose value is a literal tuple / list / set / frozenset of
three or more strings (or of ``pa.field("name", ...)`` calls, i.e. a schema's column names), and
every string constant that names a Polar protocol path or header (``/polar...``, ``x-polar-...``)
or an API path (``/v1/...``). Order does not matter: the same names in another order are the same
contract.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from tests.layout.test_imports import ALLOWED, PACKAGE_DIRS, REPO

PROTOCOL_PREFIXES = ("/polar", "x-polar", "/v1/")


def _names(node: ast.AST) -> list[str] | None:
    """The strings of a literal collection (or of a schema's pa.field calls), else None."""
    if isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Name | ast.Attribute) and \
            (node.func.id if isinstance(node.func, ast.Name) else node.func.attr) in ("frozenset", "set", "tuple",
                                                                                      "list", "schema"):
        return _names(node.args[0])
    if not isinstance(node, ast.Tuple | ast.List | ast.Set):
        return None
    out = []
    for e in node.elts:
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            out.append(e.value)
        elif isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "field" and e.args \
                and isinstance(e.args[0], ast.Constant) and isinstance(e.args[0].value, str):
            out.append(e.args[0].value)
        else:
            return None
    return out


def definitions(files: list[Path], root: Path) -> dict[tuple, list[str]]:
    """contract key -> the places (file:line) that define it."""
    seen: dict[tuple, list[str]] = defaultdict(list)
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            where = f"{path.relative_to(root)}:{node.lineno}"
            names = _names(node.value)
            if names is not None and len(names) >= 3:
                seen[("names", tuple(sorted(names)))].append(where)
            elif isinstance(node.value, ast.Constant) and isinstance(node.value.value, str) \
                    and node.value.value.startswith(PROTOCOL_PREFIXES):
                seen[("value", node.value.value)].append(where)
    return seen


def duplicates(files: list[Path], root: Path) -> list[str]:
    return [f"{key[1]!r} defined in {len(places)} places: {', '.join(places)}"
            for key, places in definitions(files, root).items() if len(places) > 1]


def product_files() -> list[Path]:
    return [p for pkg in ALLOWED for p in sorted((REPO / PACKAGE_DIRS[pkg]).rglob("*.py"))]


def test_every_contract_is_defined_once():
    dups = duplicates(product_files(), REPO)
    assert not dups, "the same contract is spelled out twice; define it once (polar_contracts) and import it:\n" + \
        "\n".join(dups)


def test_the_checker_finds_a_contract_defined_twice(tmp_path):
    """It can fail: a copied column list (reordered), a copied schema, a copied protocol path."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.py").write_text(
        'import pyarrow as pa\nCOLS = ("episode_id", "reward", "segment")\nPATH = "/polar/@weights"\n'
        'SCHEMA = pa.schema([pa.field("x", pa.int32()), pa.field("y", pa.int32()), pa.field("z", pa.int32())])\n')
    (tmp_path / "a" / "two.py").write_text(
        'MINE = ["segment", "episode_id", "reward"]\nclass C:\n    URL = "/polar/@weights"\n'
        'XYZ = frozenset({"z", "y", "x"})\nOTHER = ("a", "b")\n')
    files = sorted((tmp_path / "a").glob("*.py"))
    assert sorted(duplicates(files, tmp_path)) == [
        "'/polar/@weights' defined in 2 places: a/one.py:3, a/two.py:3",
        "('episode_id', 'reward', 'segment') defined in 2 places: a/one.py:2, a/two.py:1",
        "('x', 'y', 'z') defined in 2 places: a/one.py:4, a/two.py:4",
    ]
