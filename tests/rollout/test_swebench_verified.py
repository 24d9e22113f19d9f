"""A real SWE-bench Verified instance as published: pallets__flask-5014 (data/swebench-verified/).

The row is the dataset's, unchanged (no field added); its spec (Python 3.11, flask's requirements at
environment_setup_commit, pip_packages, `pip install -e .`, `pytest -rA`) comes from the spec tables
(specs.py), the eval script is the official one for it, and the image is built here from Debian and
PyPI (the repository from its bundle: base_commit and its ancestry only). Graded in a fresh
container by swebench's own report: the gold patch resolves it (reward 1, FAIL_TO_PASS 1/1,
PASS_TO_PASS 59/59), no change is a real 0, and an agent that plants a conftest.py passing every test
gets 0 too. The official-image path runs on a stand-in laid out as the published images are.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness_recipes.tasks.swebench.eval_script import eval_script
from harness_recipes.tasks.swebench.instances import load_instances
from harness_recipes.tasks.swebench.specs import spec_for

from .docker_agent import scripted_agent
from .test_swebench_docker import run

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "swebench-verified"
ROW = DATA / "flask-5014.jsonl"
REPOS = DATA / "repos"
IID = "pallets__flask-5014"
OFFICIAL_FIELDS = {"repo", "instance_id", "base_commit", "patch", "test_patch", "problem_statement", "hints_text",
                   "created_at", "version", "FAIL_TO_PASS", "PASS_TO_PASS", "environment_setup_commit"}
# The row's sha256 as copied from ../shared/data/swebench-real (data/swebench-verified/PROVENANCE.md).
ROW_SHA256 = "8fa9f861da54e4122387af50b3cfef0f63b0bbf3633c7d6b4dc57ee97ef38512"
TAMPER = '''import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
'''


def row() -> dict:
    return json.loads(ROW.read_text())


def flask():
    (task,) = load_instances(f"swebench:{ROW}", repos=REPOS)
    return task


def test_the_row_is_the_published_one_and_loads_unchanged():
    assert hashlib.sha256(ROW.read_bytes()).hexdigest() == ROW_SHA256
    r = row()
    assert set(r) == OFFICIAL_FIELDS  # nothing added: no eval_script, no test_cmd, no image
    t = flask()
    assert t.swebench["FAIL_TO_PASS"] == ["tests/test_blueprints.py::test_empty_name_not_allowed"]
    assert len(t.swebench["PASS_TO_PASS"]) == 59 and "eval_script" not in t.swebench
    assert t.git_repo is not None and t.git_commit == r["base_commit"]


def test_the_eval_script_is_swebench_410s_own():
    """What swebench 4.1.0's make_eval_script_list_py wrote for this row (tests/rollout/data), byte for byte."""
    r = row()
    want = (Path(__file__).parent / "data" / "flask-5014.swebench-4.1.0.eval.sh").read_text()
    assert eval_script(r, spec_for(r["repo"], r["version"]), "conda") == want
    venv = eval_script(r, spec_for(r["repo"], r["version"]), "venv")
    assert "conda" not in venv and venv.count("source /opt/polar/testbed-env/bin/activate") == 2
    assert venv.replace("source /opt/polar/testbed-env/bin/activate", "X") == want.replace(
        "source /opt/miniconda3/bin/activate\nconda activate testbed", "X")


def test_the_plan_says_buildable_with_the_repository_and_refused_without():
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    import os
    env.update({k: v for k, v in os.environ.items() if k in ("POLAR_CACHE", "HOME", "DOCKER_HOST")})
    plan = subprocess.run([sys.executable, "-m", "harness_recipes.cli", "swebench", "plan", f"swebench:{ROW}",
                           "--repos", str(REPOS), "--json"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    out = json.loads(plan.stdout)
    (d,) = out["instances"]
    assert d["instance_id"] == IID and d["python"] == "3.11"
    assert d["path"] in ("build", "official") and out["totals"]["refused"] == 0, d
    bare = subprocess.run([sys.executable, "-m", "harness_recipes.cli", "swebench", "plan", str(ROW)],
                          capture_output=True, text=True, env=env, cwd=ROOT)
    assert bare.returncode == 0, bare.stderr
    if "| official |" not in bare.stdout:
        assert "| refused | no local repository holding base_commit 7ee9ceb71e86" in bare.stdout, bare.stdout
        assert "0 buildable here, 1 refused" in bare.stdout


# ---- on docker: the image built here, graded in a fresh container -------------------------------

def _episode(tmp_path, monkeypatch, end_server, rt_cls, argv, files=()):
    prefix = tmp_path / "cache" / "fake"  # the fake harness's prefix: the only part of the cache a sandbox sees
    prefix.mkdir(parents=True, exist_ok=True)
    for name, text in files:
        (prefix / name).write_text(text)
    t0 = time.monotonic()
    recs, records = run(tmp_path, monkeypatch, end_server, rt_cls, argv, [flask()])
    (rec,) = recs.values()
    phases = {k: round(b - a, 1) for k, (a, b) in rec.get("phases", {}).items()}
    print(f"{argv[0]}: episode {time.monotonic() - t0:.1f}s, phases (s): {phases}")
    return rec, records


def test_gold_patch_resolves_it_with_the_per_test_lists(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    gold = row()["patch"]
    rec, records = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls,
                            ["apply", str(tmp_path / "cache" / "fake" / "gold.patch")], [("gold.patch", gold)])
    sb = rec["swebench"]
    assert rec["status"] == "done" and rec["reward"] == 1.0 and sb["resolved"] is True, rec
    assert sb["image_path"] == "built" and sb["image"].startswith("polar-sweb.eval.pallets_1776_flask-5014:")
    assert sb["tests"]["FAIL_TO_PASS"] == {"success": ["tests/test_blueprints.py::test_empty_name_not_allowed"],
                                           "failure": []}
    assert len(sb["tests"]["PASS_TO_PASS"]["success"]) == 59 and not sb["tests"]["PASS_TO_PASS"]["failure"]
    log = (records.episode_dir(rec["episode_id"]) / "test_output.txt").read_text()
    assert "+ source /opt/polar/testbed-env/bin/activate" in log and "+ pytest -rA tests/test_blueprints.py" in log
    # the end metadata (copied into every shard row) keeps PASS_TO_PASS as failures and counts only
    ev = end_server.ends[rec["episode_id"]]["metadata"]["eval"]
    assert ev["resolved"] is True and ev["image_path"] == "built"
    assert ev["tests"]["PASS_TO_PASS"] == {"failure": [], "success_count": 59, "failure_count": 0}
    assert ev["tests"]["FAIL_TO_PASS"] == sb["tests"]["FAIL_TO_PASS"]


def test_no_change_is_a_real_zero(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    rec, _ = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls, ["noop"])
    sb = rec["swebench"]
    assert rec["status"] == "done" and rec["reward"] == 0.0 and sb["resolved"] is False, rec
    assert sb["tests"]["FAIL_TO_PASS"]["failure"] == ["tests/test_blueprints.py::test_empty_name_not_allowed"]
    assert len(sb["tests"]["PASS_TO_PASS"]["success"]) == 59
    assert end_server.ends[rec["episode_id"]]["metadata"]["discard"] is False  # kept: the model's failure


def test_a_conftest_that_passes_everything_gets_zero(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    rec, records = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls,
                            ["write", "tests/conftest.py", TAMPER])
    assert rec["status"] == "done" and rec["reward"] == 0.0 and rec["swebench"]["resolved"] is False, rec
    ev = end_server.ends[rec["episode_id"]]["metadata"]["eval"]
    assert "tests/conftest.py" in ev["stripped_paths"], ev
    assert "b/tests/conftest.py" not in (records.episode_dir(rec["episode_id"]) / "model.patch").read_text()


def test_the_image_holds_no_commit_after_base_commit(docker_runtime_cls):
    from harness_recipes.docker_engine import docker_client
    from harness_recipes.tasks.swebench.images import instance_image
    t = flask()
    client = docker_client()
    t0 = time.monotonic()
    image, how = instance_image(client, t.swebench, t.git_repo, repos=REPOS)
    print(f"image {image} ({how}) in {time.monotonic() - t0:.1f}s")
    base = t.swebench["base_commit"]
    # one command at a time through exec (a container's log stream may lose the end of a long output)
    c = client.containers.run(image, ["sleep", "600"], detach=True, network_mode="none")
    try:
        def git(*args: str) -> list[str]:
            res = c.exec_run(["git", "-C", "/testbed", *args])
            assert res.exit_code == 0, res.output[-500:]
            return res.output.decode().split()
        every, ancestry = git("log", "--all", "--reflog", "--format=%H"), git("rev-list", base)
        refs, stash = git("for-each-ref", "--format=%(refname)"), git("stash", "list")
    finally:
        c.remove(force=True)
    assert not stash and len(every) > 1000, len(every)  # flask's history up to base_commit is all there
    assert every[0] == base and sorted(every) == sorted(ancestry), "a commit other than base_commit's history"
    assert refs == ["refs/heads/main"]
    gold_files = {line.split(" b/")[-1] for line in row()["patch"].splitlines() if line.startswith("diff --git")}
    assert gold_files == {"src/flask/blueprints.py"}


def test_an_official_image_runs_as_the_official_harness_runs_it(tmp_path, monkeypatch, end_server,
                                                               docker_runtime_cls):
    """A STAND-IN for the published image, built here: the same names (the registry's
    swebench/sweb.eval.x86_64.pallets_1776_flask-5014:latest) and layout (the test environment a
    conda-style env at /opt/miniconda3/envs/testbed, entered by `source /opt/miniconda3/bin/activate;
    conda activate testbed`; Polar's own venv removed, so only that activation finds pytest)."""
    from harness_recipes.docker_engine import docker_client
    from harness_recipes.tasks.swebench.images import find_official, instance_image, official_name, registry_name
    t = flask()
    client = docker_client()
    built, _ = instance_image(client, t.swebench, t.git_repo, repos=REPOS)
    registry = registry_name(t.swebench)
    assert registry == "swebench/sweb.eval.x86_64.pallets_1776_flask-5014:latest"
    assert official_name(t.swebench) == "sweb.eval.x86_64.pallets__flask-5014:latest"
    conda = ('conda() { if [ "$1" = activate ]; then . "/opt/miniconda3/envs/$2/bin/activate"; '
             'export CONDA_DEFAULT_ENV="$2"; else echo "stand-in conda: activate only" >&2; return 1; fi; }')
    ctx = tmp_path / "standin"
    ctx.mkdir()
    (ctx / "activate").write_text(f"# stand-in for miniconda's activate: defines conda activate ENV\n{conda}\n")
    (ctx / "Dockerfile").write_text("\n".join([
        f"FROM {built}",
        "COPY activate /opt/miniconda3/bin/activate",
        "RUN mkdir -p /opt/miniconda3/envs && cp -a /opt/polar/testbed-env /opt/miniconda3/envs/testbed "
        "&& grep -rlI /opt/polar/testbed-env /opt/miniconda3/envs/testbed/bin | xargs sed -i "
        "'s#/opt/polar/testbed-env#/opt/miniconda3/envs/testbed#g' && rm -rf /opt/polar/testbed-env",
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin VIRTUAL_ENV=", ""]))
    client.images.build(path=str(ctx), tag=registry, network_mode="none", rm=True, forcerm=True)
    try:
        assert find_official(client, t.swebench) == (registry, "official")
        gold = row()["patch"]
        rec, records = _episode(tmp_path, monkeypatch, end_server, docker_runtime_cls,
                                ["apply", str(tmp_path / "cache" / "fake" / "gold.patch")], [("gold.patch", gold)])
        sb = rec["swebench"]
        assert sb["image"] == registry and sb["image_path"] == "official", rec
        assert rec["reward"] == 1.0 and sb["resolved"] is True, rec
        log = (records.episode_dir(rec["episode_id"]) / "test_output.txt").read_text()
        assert "+ conda activate testbed" in log and "polar/testbed-env" not in log
    finally:
        client.images.remove(registry)
    assert find_official(client, t.swebench) is None


def _tampering_script(tmp_path):
    """The gold script with its first shell call replaced by the tamper: a conftest.py that passes
    every test, hidden from git status the way an agent would (.git/info/exclude)."""
    text = (DATA / "scripts" / "flask-5014.json").read_text()
    gold = json.loads(text)["rules"][1]["reply"]["tool_calls"][0]["arguments"]["command"]
    tamper = (f"cat > tests/conftest.py <<'POLAR_TAMPER_EOF'\n{TAMPER}POLAR_TAMPER_EOF\n"
              "echo tests/conftest.py >> .git/info/exclude")
    assert json.dumps(gold)[1:-1] in text
    path = tmp_path / "tamper.json"
    path.write_text(text.replace(json.dumps(gold)[1:-1], json.dumps(tamper)[1:-1]))
    return path


def _idle_script(tmp_path):
    """The gold script with its first turn answered without any tool call: no change at all."""
    script = json.loads((DATA / "scripts" / "flask-5014.json").read_text())
    script["rules"][1]["reply"] = {"content": "I looked, and I will leave the code as it is."}
    path = tmp_path / "idle.json"
    path.write_text(json.dumps(script))
    return path


@pytest.mark.parametrize("agent", ["gold", "tamper", "idle"])
def test_codex_through_the_proxy_into_shards(docker_runtime_cls, tmp_path, agent):
    """The real Codex CLI in the instance's image, through mitmdump + the Polar addon + polar-serve
    (scripted: it answers with the row's gold patch, tampers with the tests, or changes nothing),
    graded as published, into shards: 1 for the fix, a kept 0 for the tamper and for no change."""
    from harness_recipes.node.local_stack import capture_proxy, serve
    from harness_recipes.recipes.install import ensure_installed
    from harness_recipes.recipes.recipe import load_recipe
    from tests.support.servers import tiny_model_dir
    ensure_installed(load_recipe("codex"))
    logdir, out = tmp_path / "logs", tmp_path / "out"
    script = {"gold": lambda _: DATA / "scripts" / "flask-5014.json", "tamper": _tampering_script,
              "idle": _idle_script}[agent](tmp_path)
    t0 = time.monotonic()
    with serve(tiny_model_dir(), script=script) as srv, capture_proxy(srv.url, logdir) as proxy:
        proc = subprocess.run(
            [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", "codex", "--tasks", f"swebench:{ROW}",
             "--repos", str(REPOS), "--runtime", "docker", "--proxy", proxy.url, "--control-secret-file",
             str(proxy.secret_file), "--logdir", str(logdir), "--out", str(out), "--no-progress"],
            cwd=ROOT, capture_output=True, text=True, timeout=1500)
        proxy_out = proxy.output()[-3000:]
    print(f"codex episode end to end {time.monotonic() - t0:.1f}s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    brief = {k: v for k, v in rec.items() if k != "swebench"}
    assert rec["status"] == "done" and rec["harness_rc"] == 0, f"{brief}\n{proxy_out}"
    sb = rec["swebench"]
    import polars as pl
    df = pl.read_parquet(out / "shard-*.parquet").filter(pl.col("episode_id") == rec["episode_id"])
    if agent == "idle":  # no change: a real 0, kept for training (the model's failure, not ours)
        assert rec["reward"] == 0.0 and sb["resolved"] is False and not rec["changed_files"], sb
        assert df.height >= 1 and (df["reward"] == 0.0).all()
        assert sb["tests"]["FAIL_TO_PASS"]["failure"] == ["tests/test_blueprints.py::test_empty_name_not_allowed"]
        return
    if agent == "tamper":
        # the tamper is in the tree the agent left, and graded without it: the fix is missing
        assert "tests/conftest.py" in rec["changed_files"] and "src/flask/blueprints.py" not in rec["changed_files"]
        assert rec["reward"] == 0.0 and sb["resolved"] is False, sb
        assert df.height >= 1 and (df["reward"] == 0.0).all()
        assert "tests/conftest.py" in json.loads(df["eval"][0])["stripped_paths"], df["eval"][0]
        return
    assert "src/flask/blueprints.py" in rec["changed_files"], brief
    assert rec["reward"] == 1.0 and sb["resolved"] is True and sb["image_path"] in ("built", "official"), sb
    assert len(sb["tests"]["PASS_TO_PASS"]["success"]) == 59
    assert df.height >= 1 and (df["reward"] == 1.0).all()
    for r in df.iter_rows(named=True):
        ev = json.loads(r["eval"])
        assert ev["resolved"] is True and ev["instance_id"] == IID
        # one copy of the full lists per episode (the record); every shard row gets failures and counts
        assert ev["tests"]["PASS_TO_PASS"] == {"failure": [], "success_count": 59, "failure_count": 0}


def test_the_row_loads_the_same_from_parquet_and_a_saved_dataset(tmp_path):
    """As users hold the dataset: its Parquet file, or `datasets`' save_to_disk, rows unchanged."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    r = row()
    pq.write_table(pa.Table.from_pylist([r]), tmp_path / "verified.parquet")
    datasets.DatasetDict({"test": datasets.Dataset.from_list([r])}).save_to_disk(str(tmp_path / "ds"))
    want = flask().swebench
    for spec in ("verified.parquet", "ds"):
        (t,) = load_instances(f"swebench:{tmp_path / spec}", repos=REPOS)
        assert t.swebench == want, spec


def test_a_spec_that_needs_what_debian_lacks_is_refused_up_front():
    """Real Verified rows: a Python 3.6 spec is refused with the reason, before any image work; a 3.9
    one (Debian bullseye) only for want of its repository."""
    from harness_recipes.tasks.swebench.plan import decide
    tasks = {t.swebench["instance_id"]: t for t in load_instances(
        f"swebench:{DATA / 'SWE-bench_Verified-test.parquet'}", repos=REPOS,
        instances=["django__django-11099", "django__django-16255", IID])}
    d = decide(tasks["django__django-11099"].swebench, None, REPOS, client=None)
    assert (d.path, d.python) == ("refused", "3.6")
    assert d.reason.startswith("needs Python 3.6; the Debian bases ship Python 3.9 (bullseye), 3.11 (bookworm)"), d
    d = decide(tasks["django__django-16255"].swebench, None, REPOS, client=None)
    assert (d.path, d.python) == ("refused", "3.9") and d.reason.startswith("no local repository holding"), d
    f = decide(tasks[IID].swebench, tasks[IID].git_repo, REPOS, client=None)
    assert f.path == "build" and f.reason.startswith("Debian bookworm Python 3.11"), f


# ---- the whole Verified set as SWE-bench publishes it today (swebench 5 format) ----------------------

VERIFIED = DATA / "SWE-bench_Verified-test.parquet"


def test_the_500_published_rows_load_and_their_scripts_are_the_specs():
    """All of SWE-bench Verified, rows unchanged. Their published eval_script (swebench 5 writes it
    into the dataset) is, for 480 of the 500, byte for byte what the spec copy and the builder here
    give; the other 20 carry later per-instance fixes, which Polar keeps by using the row's script."""
    from harness_recipes.tasks.swebench.eval_script import script_for
    tasks = load_instances(f"swebench:{VERIFIED}")
    assert len(tasks) == 500 and len({t.swebench["instance_id"] for t in tasks}) == 500
    same = [t.id for t in tasks
            if eval_script(t.swebench, spec_for(t.swebench["repo"], t.swebench["version"]), "conda")
            == t.swebench["eval_script"]]
    assert len(same) == 480
    for t in tasks[:50]:
        inst = t.swebench
        assert script_for(inst, "official") == inst["eval_script"]
        built = script_for(inst, "built")
        assert "conda" not in built and built == inst["eval_script"].replace(
            "source /opt/miniconda3/bin/activate\nconda activate testbed", "source /opt/polar/testbed-env/bin/activate")


def test_the_plan_over_the_published_verified_set(tmp_path):
    import os
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
           **{k: v for k, v in os.environ.items() if k in ("POLAR_CACHE", "HOME", "DOCKER_HOST")}}
    t0 = time.monotonic()
    plan = subprocess.run([sys.executable, "-m", "harness_recipes.cli", "swebench", "plan", f"swebench:{VERIFIED}",
                           "--repos", str(REPOS), "--json"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert plan.returncode == 0, plan.stderr
    out = json.loads(plan.stdout)
    print(f"plan of 500 instances in {time.monotonic() - t0:.1f}s: {out['totals']}")
    t = out["totals"]
    assert t["instances"] == 500 and t["official"] + t["build"] + t["refused"] == 500
    by_id = {d["instance_id"]: d for d in out["instances"]}
    assert by_id[IID]["path"] in ("build", "official")
    for d in out["instances"]:
        assert d["path"] in ("official", "build", "refused") and d["reason"], d
        if d["path"] == "refused" and d["python"] not in ("3.9", "3.11", ""):
            assert d["reason"].startswith(f"needs Python {d['python']}; the Debian bases ship"), d
    dj = by_id["django__django-11099"]  # django 3.0: Python 3.6, in no Debian suite here
    assert dj["path"] == "official" or dj["reason"].startswith("needs Python 3.6"), dj
    dj = by_id["django__django-16255"]  # django 4.2: Python 3.9 (bullseye), but no repository here
    assert dj["path"] == "official" or dj["reason"].startswith("no local repository holding base_commit"), dj
    # docs/swebench.md keeps only a per-repo summary of this plan (the table itself is printed on
    # demand): it must be what the command says; build / refused only hold with no official image
    doc = plan_summary_in_docs()
    per_repo = {}
    for d in out["instances"]:
        counts = per_repo.setdefault(d["repo"], {"instances": 0, "build": 0, "refused": 0, "official": 0})
        counts["instances"] += 1
        counts[d["path"]] += 1
    assert {r: c["instances"] for r, c in per_repo.items()} == {r: c["instances"] for r, c in doc.items()}
    if t["official"] == 0:
        assert {r: (c["build"], c["refused"]) for r, c in per_repo.items()} == \
            {r: (c["build"], c["refused"]) for r, c in doc.items()}


def plan_summary_in_docs() -> dict[str, dict[str, int]]:
    """The per-repo table under "Planning" in docs/swebench.md: repo -> instances, build, refused."""
    text = (ROOT / "docs" / "swebench.md").read_text()
    head = "| repo | instances | buildable here | refused |"
    assert head in text, f"docs/swebench.md lost its plan summary table ({head})"
    rows = {}
    for line in text.split(head, 1)[1].splitlines()[2:]:
        if not line.startswith("|"):
            break
        repo, n, build, refused = (c.strip() for c in line.strip("|").split("|"))
        rows[repo] = {"instances": int(n), "build": int(build), "refused": int(refused)}
    return rows


def test_the_published_flask_row_runs_on_the_image_built_here(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    """The swebench 5 row (eval_script for the official image, image name, parse_log_flask) on the
    image built here: its own script with the venv's activation, the gold patch resolves it."""
    (t,) = load_instances(f"swebench:{VERIFIED}", repos=REPOS, instances=[IID])
    assert t.swebench["log_parser"] == "parse_log_flask" and t.swebench["image"].startswith("swebench/")
    prefix = tmp_path / "cache" / "fake"  # the fake harness's prefix: the only part of the cache a sandbox sees
    prefix.mkdir(parents=True)
    (prefix / "gold.patch").write_text(t.swebench["patch"])
    recs, records = run(tmp_path, monkeypatch, end_server, docker_runtime_cls,
                        ["apply", str(prefix / "gold.patch")], [t])
    (rec,) = recs.values()
    sb = rec["swebench"]
    assert rec["reward"] == 1.0 and sb["resolved"] is True and sb["image_path"] == "built", rec
    assert len(sb["tests"]["PASS_TO_PASS"]["success"]) == 59
    log = (records.episode_dir(rec["episode_id"]) / "test_output.txt").read_text()
    assert "+ source /opt/polar/testbed-env/bin/activate" in log and "conda" not in log


def test_the_two_copies_of_the_flask_row_agree():
    import pyarrow.parquet as pq
    (pub,) = [r for r in pq.read_table(VERIFIED).to_pylist() if r["instance_id"] == IID]
    assert {k: pub[k] for k in OFFICIAL_FIELDS} == row()
    assert hashlib.sha256(VERIFIED.read_bytes()).hexdigest() == (
        "9cf3c8d406a3878dffdec80e1933b2601d00fd5868aabbe6f268c0a29484f21a")


def test_run_leaves_refused_instances_out_up_front_saying_why(capsys):
    """`polar-rollout run/fleet` plan before any episode: a refused instance never reaches an image build
    or an eval_error; it is named on stderr with its reason, and the others run."""
    import pytest

    from harness_recipes.cli import _runnable
    from harness_recipes.tasks.task_file import TaskError
    tasks = load_instances(f"swebench:{VERIFIED}", repos=REPOS, instances=["django__django-16255", IID])
    kept = _runnable(tasks)
    err = capsys.readouterr().err
    assert [t.swebench["instance_id"] for t in kept] == [IID] or "django__django-16255" not in err
    if len(kept) == 1:  # (an engine holding django's official image would keep both)
        assert "refused django__django-16255: no local repository holding base_commit" in err
        with pytest.raises(TaskError, match="every instance was refused"):
            _runnable([t for t in tasks if t.swebench["instance_id"] != IID])


# the printed-PASSED attack: printed after pytest's own summary, these lines win in swebench's parser
FORGE_PASSED = '''

import atexit as _atexit, re as _re, sys as _sys


def _forge():
    for a in _sys.argv[1:]:
        f = a.split("::")[0]
        if f.endswith(".py"):
            for name in _re.findall(r"def (test\\w*)", open(f).read()):
                print(f"PASSED {f}::{name}")
_atexit.register(_forge)
'''


def test_a_forged_log_is_tampered_and_the_gold_patch_still_resolves(tmp_path, docker_runtime_cls):
    """The flask row in docker through grade_episode: the agent appends an atexit hook printing
    `PASSED <file>::<test>` for every test to the module under test (no fix): swebench's parser alone
    resolves it (the record's official_resolved), the JUnit XML and the canaries do not: reward 0,
    tampered, graded (no eval error). The gold patch in the same setting: 1.0, passed."""
    import asyncio

    t = flask()
    rt = docker_runtime_cls(network="none", memory="2g", cpus=1.0, workdir=str(tmp_path))

    agent = scripted_agent(rt, t, "src/flask/blueprints.py", tmp_path)

    async def go():
        try:
            return await agent("forge.s0", None, FORGE_PASSED), await agent("gold.s0", t.swebench["patch"], None)
        finally:
            await rt.shutdown()

    forged, gold = asyncio.run(go())
    log = (tmp_path / "out" / "forge.s0" / "test_output.txt").read_text()
    assert "PASSED tests/test_blueprints.py::test_empty_name_not_allowed" in log.splitlines()  # the forgery ran
    assert forged.swebench["official_resolved"] is True and forged.swebench["resolved"] is False, forged.swebench
    assert forged.reward == 0.0 and not forged.error and forged.eval["tampered"] is True, forged.eval
    assert any("disagree" in r for r in forged.eval["verdict_reasons"]), forged.eval
    assert gold.reward == 1.0 and gold.eval["verdict"] == "passed" and gold.swebench["resolved"] is True, gold.eval
    assert gold.eval["evidence"]["checked"] is True and gold.eval["evidence"]["exit_status"] == 1, gold.eval
    assert gold.eval["tests"]["PASS_TO_PASS"] == {"failure": [], "success_count": 59, "failure_count": 0}
