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
