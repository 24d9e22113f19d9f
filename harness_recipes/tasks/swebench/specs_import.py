"""Copy SWE-bench's per-repo/version specs out of a swebench release into the repository.

    python -m harness_recipes.tasks.swebench.specs_import swebench-4.1.0-py3-none-any.whl

swebench 5 no longer ships MAP_REPO_VERSION_TO_SPECS (Python version, packages, install and
pre-install commands, test command per repo and version); swebench 4.1.0, the last release that
does, keeps them in swebench/harness/constants/*.py. This reads those modules straight out of the
wheel (their own package only: the rest of swebench, with its network code, is not imported) and
writes the data, with the wheel's and each file's sha256 and the MIT licence text, to specs_data/.
Run once by a maintainer; nothing at run time reads the network.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import types
import zipfile
from importlib.resources import files
from pathlib import Path

OUT = Path(str(files("harness_recipes.tasks.swebench") / "specs_data"))
FILES = ("__init__.py", "c.py", "go.py", "java.py", "javascript.py", "php.py", "python.py", "ruby.py", "rust.py")
# Data, not code: the maps the official script builders read (test_spec/python.py in 4.1.0).
KEYS = ("MAP_REPO_VERSION_TO_SPECS", "MAP_REPO_TO_REQS_PATHS", "MAP_REPO_TO_ENV_YML_PATHS", "MAP_REPO_TO_INSTALL",
        "MAP_REPO_TO_EXT", "NON_TEST_EXTS", "START_TEST_OUTPUT", "END_TEST_OUTPUT", "USE_X86")
# test_spec/python.py's REPLACE_REQ_PACKAGES, read from that file's text below (a literal list).
REPLACE_KEY = "REPLACE_REQ_PACKAGES"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_constants(root: Path) -> types.ModuleType:
    """swebench.harness.constants from an unpacked wheel, without running swebench/__init__.py: empty
    parent packages whose __path__ is the wheel's directories lead the import system there (this
    process's own swebench, if any, is shadowed for the rest of it: a one-shot command)."""
    for name in ("swebench", "swebench.harness", "swebench.harness.constants"):
        sys.modules.pop(name, None)
    for name in ("swebench", "swebench.harness"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / name.replace(".", "/"))]
        sys.modules[name] = pkg
    import importlib
    return importlib.import_module("swebench.harness.constants")


def replace_req_packages(text: str) -> list:
    import ast
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == REPLACE_KEY for t in node.targets):
            return [list(x) for x in ast.literal_eval(node.value)]
    raise SystemExit(f"{REPLACE_KEY} not found in test_spec/python.py")


def main(wheel: str) -> None:
    data = Path(wheel).read_bytes()
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp)
        root = Path(tmp)
        version = next(root.glob("swebench-*.dist-info")).name[len("swebench-"):-len(".dist-info")]
        const = load_constants(root)
        files = {f"swebench/harness/constants/{f}": _sha((root / "swebench/harness/constants" / f).read_bytes())
                 for f in FILES}
        py = root / "swebench/harness/test_spec/python.py"
        files["swebench/harness/test_spec/python.py"] = _sha(py.read_bytes())
        out = {k: getattr(const, k) for k in KEYS}
        out["USE_X86"] = sorted(out["USE_X86"])
        out[REPLACE_KEY] = replace_req_packages(py.read_text())
        licence = next(root.glob("swebench-*.dist-info/licenses/LICENSE")).read_text()
    provenance = {"package": "swebench", "version": version, "wheel": Path(wheel).name, "wheel_sha256": _sha(data),
                  "source": f"https://pypi.org/project/swebench/{version}/", "files_sha256": files,
                  "licence": "MIT (LICENSE beside this file, from the wheel's dist-info)"}
    OUT.mkdir(exist_ok=True)
    (OUT / f"swebench-{version}.json").write_text(
        json.dumps({"provenance": provenance, **out}, indent=1, sort_keys=True) + "\n")
    (OUT / "LICENSE").write_text(licence)
    print(f"wrote {OUT / f'swebench-{version}.json'}: {len(out['MAP_REPO_VERSION_TO_SPECS'])} repos")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
