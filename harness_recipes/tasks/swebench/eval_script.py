"""The official eval script of a Python SWE-bench instance, from its spec.

The same commands, in the same order, as swebench 4.1.0's make_eval_script_list_py (the last
release that builds them from the spec; swebench 5 datasets carry the finished script instead):
activate the test environment, record the tree, re-run the spec's install, reset the test files
to base_commit, apply test_patch in a heredoc, run the spec's test command on the test files the
patch touches between the official markers, reset. tests/rollout/data holds the script swebench
4.1.0 itself wrote for pallets__flask-5014, and a test holds this builder to it byte for byte.

Only the environment's activation differs with the image (ENVIRONMENTS):
- ``conda``: the official instance images (swebench's own build, or pulled): the conda env
  /opt/miniconda3/envs/testbed, activated as the official harness does;
- ``venv``: the images Polar builds from the spec (images.py): a Python venv at VENV.

swebench 5 datasets carry the finished script (`eval_script`, written for the official images,
with later per-instance fixes): `script_for` keeps it and, in an image built here, swaps only its
conda activation for the venv's.
"""
from __future__ import annotations

import re

from harness_recipes.tasks.swebench.specs import tables

HEREDOC = "EOF_114329324912"
ENV_NAME = "testbed"
VENV = "/opt/polar/testbed-env"
ENVIRONMENTS = {
    "conda": ["source /opt/miniconda3/bin/activate", f"conda activate {ENV_NAME}"],
    "venv": [f"source {VENV}/bin/activate"],
}


def test_directives(inst: dict) -> list[str]:
    """The test files test_patch touches, as the spec's test command takes them (swebench's own rule:
    non-test extensions dropped; django's as dotted module names under tests/)."""
    non_test = tables()["NON_TEST_EXTS"]
    directives = re.findall(r"diff --git a/.* b/(.*)", inst["test_patch"])
    directives = [d for d in directives if not any(d.endswith(ext) for ext in non_test)]
    if inst["repo"] == "django/django":
        out = []
        for d in directives:
            d = d[: -len(".py")] if d.endswith(".py") else d
            d = d[len("tests/"):] if d.startswith("tests/") else d
            out.append(d.replace("/", "."))
        directives = out
    return directives


def eval_script(inst: dict, spec: dict, environment: str, workdir: str = "/testbed") -> str:
    from swebench.utils import get_modified_files
    if environment not in ENVIRONMENTS:
        raise ValueError(f"environment must be one of {sorted(ENVIRONMENTS)}, not {environment!r}")
    t = tables()
    activate = ENVIRONMENTS[environment]
    base = inst["base_commit"]
    reset = f"git checkout {base} {' '.join(get_modified_files(inst['test_patch']))}"
    test_cmd = spec["test_cmd"]
    if not isinstance(test_cmd, str):
        raise ValueError(f"{inst['instance_id']}: the spec's test_cmd is not one command: {test_cmd!r}")
    cmds = [*activate, f"cd {workdir}"]
    cmds += list(spec.get("eval_commands", []))
    cmds += [f"git config --global --add safe.directory {workdir}", f"cd {workdir}", "git status", "git show",
             f"git -c core.fileMode=false diff {base}", *activate]
    if "install" in spec:
        cmds.append(spec["install"])
    cmds += [reset, f"git apply -v - <<'{HEREDOC}'\n{inst['test_patch']}\n{HEREDOC}",
             f": '{t['START_TEST_OUTPUT']}'", " ".join([test_cmd, *test_directives(inst)]),
             f": '{t['END_TEST_OUTPUT']}'", reset]
    return "\n".join(["#!/bin/bash", "set -uxo pipefail", *cmds]) + "\n"


def spec_based(inst: dict) -> bool:
    """An official SWE-bench row: installed and tested by its spec (built here as environment.py says).
    Not Polar's bundled instances (polar_source) nor a row whose own test_cmd says how: those run
    their eval_script on the Debian base as is."""
    from harness_recipes.tasks.swebench.specs import SpecError, spec_for
    if inst.get("polar_source") or inst.get("test_cmd"):
        return False
    try:
        spec_for(inst["repo"], inst["version"])
        return True
    except SpecError:
        return not inst.get("eval_script")  # no spec, no script: the plan refuses it, saying so


def script_for(inst: dict, image_path: str) -> str:
    """The eval script for an instance in an image: 'official' (its conda env) or 'built' (the venv)."""
    from harness_recipes.tasks.swebench.specs import spec_for
    if not spec_based(inst):
        return inst["eval_script"]
    row = inst.get("eval_script") or ""
    conda, venv = "\n".join(ENVIRONMENTS["conda"]), "\n".join(ENVIRONMENTS["venv"])
    if image_path == "official":
        return row or eval_script(inst, spec_for(inst["repo"], inst["version"]), "conda")
    if row and conda in row:
        return row.replace(conda, venv)
    return eval_script(inst, spec_for(inst["repo"], inst["version"]), "venv")
