"""SWE-bench instances as rollout tasks: the official instance format in, tasks out.

    polar-rollout run --tasks swebench:FILE [--instances ID,ID] [--limit N] ...

FILE: a JSONL file, a Parquet file, or a Hugging Face `datasets` dataset saved to disk
(`Dataset.save_to_disk`; a DatasetDict must hold one split, or a split named ``test``). Each row is
one SWE-bench instance with the official fields

    instance_id, repo, base_commit, problem_statement, test_patch, patch, FAIL_TO_PASS,
    PASS_TO_PASS, version, environment_setup_commit

(FAIL_TO_PASS / PASS_TO_PASS: a list, or the JSON-encoded list of the published files), and the
fields swebench >= 5 datasets add to say how to test it: ``eval_script`` (the bash script that
resets the test files, applies test_patch, runs the tests between the official output markers),
``log_parser`` (a name in swebench's PARSER_REGISTRY), ``eval_type``, optionally ``image``.
A row without ``eval_script`` may give ``test_cmd`` instead; `eval_script_for` then builds the
script in the official shape. Polar's own bundled instances (data/swebench/) add ``polar_source``:
the PyPI sdist and planted-bug patch their repository is built from (sources.py).

Where the repository comes from, per instance: a local clone ``REPOS/owner__name`` (--repos), else
the ``polar_source`` build, else only the instance's docker image (its /testbed): such a task runs
on the docker runtime only. Grading is swebench's own (grade.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from harness_recipes.tasks.swebench.grade import known_parser, parser_for_repo
from harness_recipes.tasks.swebench.sources import SourceError, clone_bundle, ensure_repo
from harness_recipes.tasks.task_file import ID_RE, Task, TaskError, _jsonl

PREFIX = "swebench:"
REQUIRED_STR = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "patch",
                "environment_setup_commit")
SHA_RE = re.compile(r"^[0-9a-f]{7,40}$")
REPO_RE = re.compile(r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$")
DEFAULT_TIMEOUT = 1800.0
DEFAULT_EVAL_TIMEOUT = 900.0
# The official markers and heredoc delimiter of swebench's eval scripts (kept byte-identical so the
# log has the shape swebench's grading expects).
HEREDOC = "EOF_114329324912"


def is_swebench_spec(spec: str) -> bool:
    return spec.startswith(PREFIX)


# ---- reading rows --------------------------------------------------------------------------------

def read_rows(path: Path) -> list[tuple[str, dict]]:
    """(where, row) for every row of a JSONL file, a Parquet file, or a dataset saved to disk."""
    if path.is_dir():
        return _dataset_rows(path)
    if not path.is_file():
        raise TaskError(f"swebench instances not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a bad file
            raise TaskError(f"{path}: not a readable Parquet file: {e}") from None
        return [(f"{path} row {i}", r) for i, r in enumerate(rows)]
    return _jsonl(path)


def _dataset_rows(path: Path) -> list[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise TaskError(f"{path} is a directory: reading a dataset saved with save_to_disk needs the "
                        "`datasets` package (pip install datasets)") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as e:
        raise TaskError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) == 1:
            ds = ds[splits[0]]
        elif "test" in ds:
            ds = ds["test"]
        else:
            raise TaskError(f"{path}: a DatasetDict with splits {splits}: save the split to run (or name it 'test')")
    return [(f"{path} row {i}", dict(r)) for i, r in enumerate(ds)]


# ---- validating one row --------------------------------------------------------------------------

def test_list(row: dict, key: str, where: str) -> list[str]:
    """FAIL_TO_PASS / PASS_TO_PASS: a list of test names, or that list JSON-encoded (the published files)."""
    if key not in row:
        raise TaskError(f"{where}: missing required field {key!r}")
    v = row[key]
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}: field {key!r} is a string but not a JSON list: {e}") from None
    if not isinstance(v, list) or not all(isinstance(t, str) for t in v):
        raise TaskError(f"{where}: field {key!r} must be a list of test names (or its JSON encoding)")
    return list(v)


def validate(row: dict, where: str) -> dict:
    """The row with its fields checked and normalised (test lists decoded, version a string)."""
    out = dict(row)
    for key in REQUIRED_STR:
        if key not in row:
            raise TaskError(f"{where}: missing required field {key!r}")
        if not isinstance(row[key], str):
            raise TaskError(f"{where}: field {key!r} must be a string, got {type(row[key]).__name__}")
    where = f"{where} ({row['instance_id']})"
    if not REPO_RE.match(row["repo"]):
        raise TaskError(f"{where}: field 'repo' must be owner/name, got {row['repo']!r}")
    for key in ("base_commit", "environment_setup_commit"):
        if not SHA_RE.match(row[key]):
            raise TaskError(f"{where}: field {key!r} must be a git commit sha, got {row[key]!r}")
    if not row["test_patch"].strip():
        raise TaskError(f"{where}: field 'test_patch' is empty (the tests that check the fix)")
    if "version" not in row:
        raise TaskError(f"{where}: missing required field 'version'")
    if isinstance(row["version"], bool) or not isinstance(row["version"], (str, int, float)):
        raise TaskError(f"{where}: field 'version' must be a string, got {type(row['version']).__name__}")
    out["version"] = str(row["version"])
    out["FAIL_TO_PASS"] = test_list(row, "FAIL_TO_PASS", where)
    out["PASS_TO_PASS"] = test_list(row, "PASS_TO_PASS", where)
    if not out["FAIL_TO_PASS"]:
        raise TaskError(f"{where}: field 'FAIL_TO_PASS' is empty: nothing would tell a fix from no fix")
    if not isinstance(row.get("eval_script") or "", str):
        raise TaskError(f"{where}: field 'eval_script' must be a string")
    if row.get("test_cmd") is not None and not isinstance(row["test_cmd"], str):
        raise TaskError(f"{where}: field 'test_cmd' must be a string")
    parser = row.get("log_parser") or _default_parser(row["repo"])
    if not known_parser(parser):
        raise TaskError(f"{where}: field 'log_parser' {parser!r} is not a parser swebench knows")
    out["log_parser"] = parser
    out["eval_type"] = row.get("eval_type") or "pass_and_fail"
    if out["eval_type"] not in ("pass_and_fail", "fail_only"):
        raise TaskError(f"{where}: field 'eval_type' must be pass_and_fail or fail_only, got {out['eval_type']!r}")
    if out.get("eval_script") or out.get("test_cmd"):
        out["eval_script"] = eval_script_for(out)
    else:
        # An official row (swebench < 5 format): its spec (specs.py) says how to install and test it;
        # the eval script depends on the image it runs in (eval_script.script_for), chosen per instance.
        out.pop("eval_script", None)
    return out


def _default_parser(repo: str) -> str:
    """An older-format row names no parser: swebench's own repo -> parser map, else its pytest parser."""
    return parser_for_repo(repo)


def test_files(patch: str) -> list[str]:
    """Files a diff touches (as the official eval scripts reset them before applying test_patch)."""
    from swebench.utils import get_modified_files
    return get_modified_files(patch)


def eval_script_for(inst: dict, workdir: str = "/testbed") -> str:
    """The instance's eval_script, or one built from test_cmd in the official shape: reset the test
    files to base_commit, apply test_patch, run the tests between the official markers, reset."""
    if inst.get("eval_script"):
        return inst["eval_script"]
    from swebench.harness.constants import END_TEST_OUTPUT, START_TEST_OUTPUT
    files = " ".join(test_files(inst["test_patch"]))
    base = inst["base_commit"]
    # test_patch may only add files: then there is nothing to reset.
    reset = f"git checkout {base} {files}" if files else ": no test files to reset"
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", f"cd {workdir}", "git status",
        f"git -c core.fileMode=false diff {base}", reset,
        f"git apply -v - <<'{HEREDOC}'\n{inst['test_patch']}\n{HEREDOC}",
        f": '{START_TEST_OUTPUT}'", inst["test_cmd"], f": '{END_TEST_OUTPUT}'", reset, ""])


# ---- rows -> tasks ------------------------------------------------------------------------------

def task_id(instance_id: str) -> str:
    tid = re.sub(r"[^A-Za-z0-9._-]", "_", instance_id)[:100]
    if not ID_RE.match(tid):
        raise TaskError(f"instance id {instance_id!r} gives no usable task id")
    return tid


def load_instances(spec: str | Path, repos: str | Path | None = None, instances: list[str] | None = None,
                   limit: int | None = None, timeout: float = DEFAULT_TIMEOUT,
                   pythons: dict[str, str] | None = None) -> list[Task]:
    """Tasks from a file of SWE-bench instances (spec: 'swebench:FILE' or FILE), filtered. pythons: the
    user's interpreters for versions Debian lacks ({"3.6": DIR}, `--python`, checked by
    pythons.parse_pythons), carried in each row as `polar_pythons` like `polar_repos`."""
    try:
        import swebench  # noqa: F401  (grading, parsers and image names are swebench's own)
    except ImportError:
        raise TaskError("SWE-bench tasks need the swebench package: pip install 'polar[swebench]' "
                        "(swebench==5.0.2)") from None
    s = str(spec)
    path = Path(s[len(PREFIX):] if s.startswith(PREFIX) else s)
    rows = read_rows(path)
    if not rows:
        raise TaskError(f"{path}: no instances")
    checked = []
    seen: set[str] = set()
    for where, row in rows:
        if not isinstance(row, dict):
            raise TaskError(f"{where}: each row must be an object")
        inst = validate(row, where)
        if inst["instance_id"] in seen:
            raise TaskError(f"{where}: duplicate instance_id {inst['instance_id']!r}")
        seen.add(inst["instance_id"])
        checked.append((where, inst))
    if instances:
        missing = [i for i in instances if i not in seen]
        if missing:
            raise TaskError(f"--instances: not in {path}: {', '.join(missing)}")
        wanted = set(instances)
        checked = [(w, i) for w, i in checked if i["instance_id"] in wanted]
    if limit is not None:
        if limit < 1:
            raise TaskError(f"--limit must be at least 1, got {limit}")
        checked = checked[:limit]
    return [_task(inst, where, path.parent if path.is_file() else path, repos, timeout, pythons)
            for where, inst in checked]


def local_repo(repos, repo: str) -> Path | None:
    """REPOS/owner__name: a clone (or bare repository), else REPOS/owner__name.bundle, cloned once into
    the cache (a bundle is how a repository travels as one file, e.g. the repository at base_commit)."""
    if repos is None:
        return None
    clone = Path(repos) / repo.replace("/", "__")
    if (clone / ".git").exists() or (clone / "HEAD").exists():
        return clone.resolve()
    bundle = clone.with_name(clone.name + ".bundle")
    if bundle.is_file():
        try:
            return clone_bundle(bundle)
        except SourceError as e:
            raise TaskError(f"--repos: {e}") from None
    return None


def _task(inst: dict, where: str, base: Path, repos, timeout: float, pythons: dict[str, str] | None = None) -> Task:
    git_repo = local_repo(repos, inst["repo"])
    if git_repo is None and inst.get("polar_source"):
        try:
            git_repo = ensure_repo(inst, base)
        except SourceError as e:
            raise TaskError(f"{where}: field 'polar_source': {e}") from None
    eval_timeout = inst.get("eval_timeout", DEFAULT_EVAL_TIMEOUT)
    if isinstance(eval_timeout, bool) or not isinstance(eval_timeout, (int, float)) or eval_timeout <= 0:
        raise TaskError(f"{where}: field 'eval_timeout' must be a positive number of seconds")
    return Task(
        id=task_id(inst["instance_id"]),
        prompt=inst["problem_statement"],
        eval_cmd="",  # graded by swebench (grade.py), not by an exit status
        git_repo=git_repo,
        git_commit=inst["base_commit"] if git_repo is not None else None,
        timeout=float(inst.get("timeout", timeout)),
        eval_timeout=float(eval_timeout),
        swebench={**inst, "polar_repos": str(Path(repos).resolve()) if repos is not None else None,
                  **({"polar_pythons": dict(pythons)} if pythons else {})},
    )
