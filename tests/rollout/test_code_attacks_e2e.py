"""The hacks of the code under test, each through `polar-rollout run` into shards.

One run per setting, one group of episodes: a scripted agent per episode (fake_harness.py
`per-sample`: the harness makes its own model call, then runs the episode's shell script as its
shell tool would) fixes the bug, changes nothing, or appends one of the
HACKS of harness_recipes/attacks/agent.py to the module under test (no test file touched), or leaves
sparse files and a symlink chain while calling the model from its own command. The run goes the
whole way: sandbox, agent, grading in a fresh sandbox, end, shards (polar-recon build).

Settings: the bundled fix-add task (unittest) on local+bubblewrap and on docker, and the published SWE-bench
Verified flask row (pallets__flask-5014, pytest -rA, swebench's parser) in its docker image, the
hacks appended to src/flask/blueprints.py, which every test imports through flask/__init__.py.

Per episode, checked from outside the sandbox: status done, the graded reward (1.0 for the fix,
0.0 for everything else), the eval verdict and its tampered flag, the log's end kept (discard
false), and every shard row of the episode carrying that reward and verdict. The sparse files and
the symlink chain end in the dropped paths, not in the patch; the agent's own model calls were
refused (counted in the eval metadata) and its prompt is in no shard.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.attacks.agent import HACKS
from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.runtimes.local import bwrap_available
from polar_contracts.log.reader import read_episode
from tests.support.servers import tiny_model_dir

from .conftest import FAKE, fake_recipe_text

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "data" / "tasks" / "tasks.jsonl"
FLASK_ROW = ROOT / "data" / "swebench-verified" / "flask-5014.jsonl"
REPOS = ROOT / "data" / "swebench-verified" / "repos"
MARKER = "polar-own-call-prompt-7d1c"  # the agent's own model calls carry it: it must reach no shard


def append(module: str, code: str) -> str:
    return f"cat >> {module} <<'POLAR_HACK_EOF'\n\n\n{code}POLAR_HACK_EOF\n"


def tree_attack() -> str:
    """Sparse files (60 MiB each, nothing on disk), a symlink chain out of the tree, and model calls
    from the agent's own command (a child of the harness) with a prompt it chose."""
    call = ("import json, os, urllib.request as u\n"
            "body = json.dumps({'model': os.environ.get('FAKE_MODEL', 'polar-model'), 'max_tokens': 4,\n"
            f"                   'messages': [{{'role': 'user', 'content': '{MARKER}'}}]}}).encode()\n"
            "url = os.environ['FAKE_BASE'].rstrip('/') + '/v1/chat/completions'\n"
            "for _ in range(3):\n"
            "    try:\n"
            "        print(u.urlopen(u.Request(url, data=body, headers={'Content-Type': 'application/json'}),\n"
            "                        timeout=30).status)\n"
            "    except Exception as e:\n"
            "        print('refused:', e)\n")
    return ("for i in 0 1 2 3 4 5 6 7; do truncate -s 60M polar-sparse-$i.bin; done\n"
            "mkdir -p polar_chain && ln -s .. polar_chain/b && ln -s polar_chain/b/.. polar_esc\n"
            f"python3 - <<'POLAR_CALL_EOF'\n{call}POLAR_CALL_EOF\n")


# sample -> (what the agent does, the verdict its grading must give); the fix and the no-op first
def agents(module: str, fix: str, verdicts: dict[str, str]) -> dict[int, tuple[str, str, str]]:
    out = {0: ("fix", fix, "passed"), 1: ("noop", "true\n", "failed")}
    for i, hack in enumerate(HACKS):
        out[2 + i] = (hack, append(module, HACKS[hack]), verdicts[hack])
    out[2 + len(HACKS)] = ("tree", tree_attack(), "failed")
    return out


BUNDLED = dict(task="bundled", module="calc.py", fix="sed -i 's/return a - b/return a + b/' calc.py\n",
               # fix-add as it ships (python3 -m unittest, Polar's runner records the outcomes): a hack
               # that changes nothing the verdict reads is a plain failure
               verdicts={"atexit_exit": "tampered", "patched_results": "tampered", "passed_printer": "failed",
                         "errored_printer": "failed"})
SETTINGS = {
    "local-bundled": dict(runtime="local", **BUNDLED),
    "docker-bundled": dict(runtime="docker", **BUNDLED),
    # the published flask row: the printed lines reach swebench's parser, the JUnit XML and the
    # canaries disagree with them
    "docker-flask": dict(
        runtime="docker", task="flask", module="src/flask/blueprints.py", fix=None,
        verdicts={"atexit_exit": "tampered", "patched_results": "tampered", "passed_printer": "tampered",
                  "errored_printer": "tampered"}),
}


def install_agents(tmp_path: Path, scripts: dict[int, tuple[str, str, str]], gold: str | None) -> tuple[Path, dict]:
    """The fake harness in its own prefix of a harness cache (the part a sandbox sees), the per-sample
    scripts beside it; returns the recipe and the environment that names the cache."""
    prefix = tmp_path / "cache" / "fake"
    agents_dir = prefix / "agents"
    agents_dir.mkdir(parents=True)
    shutil.copy(FAKE, prefix / "fake_harness.py")
    (prefix / "bin").mkdir()
    (prefix / "bin" / "python3").symlink_to("/usr/bin/python3")  # containers see the system python3 under /usr
    if gold is not None:
        (prefix / "gold.patch").write_text(gold)
    for n, (_, text, _) in scripts.items():
        (agents_dir / f"s{n}.sh").write_text("set -e\n" + text)
    recipe = tmp_path / "scripted.toml"
    text = fake_recipe_text(["chat", "1", "per-sample", str(agents_dir)], name="scripted", via="path")
    recipe.write_text(text.replace(str(FAKE), str(prefix / "fake_harness.py"))
                      .replace(f'bin = "{sys.executable}"', f'bin = "{prefix / "bin" / "python3"}"'))
    env = {**os.environ, "POLAR_HARNESS_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    return recipe, env


def _sample(eid: str) -> int:
    return int(eid.split("~", 1)[0].rsplit(".s", 1)[1])


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_each_hack_of_the_code_under_test_trains_a_zero(setting, tmp_path, request):
    s = SETTINGS[setting]
    if s["runtime"] == "docker":
        request.getfixturevalue("docker_runtime_cls")  # skipped, saying why, without a Docker engine
    elif not bwrap_available():
        pytest.skip("bubblewrap cannot create namespaces here: local grading is tamper-proof only under it")
    if s["task"] == "flask":
        gold = json.loads(FLASK_ROW.read_text())["patch"]
        fix = f"git apply --whitespace=nowarn {tmp_path / 'cache' / 'fake' / 'gold.patch'}\n"
        tasks = ["--tasks", f"swebench:{FLASK_ROW}", "--repos", str(REPOS)]
    else:
        gold, fix = None, s["fix"]
        line = json.loads(TASKS.read_text().splitlines()[0])  # fix-add, as it ships
        assert line["id"] == "fix-add"
        one = tmp_path / "fix-add.jsonl"
        # (its polar-serve script is the codex demo's: not this scripted agent's)
        line = {k: v for k, v in line.items() if k != "script"}
        one.write_text(json.dumps({**line, "workspace": str(TASKS.parent / line["workspace"])}) + "\n")
        tasks = ["--tasks", str(one)]
    scripts = agents(s["module"], fix, s["verdicts"])
    recipe, env = install_agents(tmp_path, scripts, gold)
    logdir, out = tmp_path / "logs", tmp_path / "out"
    with serve(tiny_model_dir()) as srv, capture_proxy(srv.url, logdir) as proxy:
        proc = subprocess.run(
            [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", str(recipe), *tasks,
             "--samples", str(len(scripts)), "--runtime", s["runtime"], "--proxy", proxy.url,
             "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir), "--out", str(out),
             "--concurrency", "2", "--prewarm", "2", "--eval-concurrency", "2", "--no-progress"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recs = {_sample(r["episode_id"]): r for r in map(json.loads, (out / "rollout" / "episodes.jsonl").read_text()
                                                         .splitlines())}
    assert sorted(recs) == sorted(scripts), sorted(recs)

    import polars as pl
    shards = pl.read_parquet(out / "shard-*.parquet")
    summary = {}
    for n, (what, _, verdict) in scripts.items():
        r = recs[n]
        ev = r.get("eval") or {}
        brief = {k: v for k, v in r.items() if k not in ("swebench",)}
        summary[what] = (r["status"], r["reward"], ev.get("verdict"))
        assert r["status"] == "done", (what, brief)
        want = 1.0 if what == "fix" else 0.0
        assert r["reward"] == want and ev["verdict"] == verdict, (what, brief)
        assert ev["tampered"] is (verdict == "tampered"), (what, ev)
        if what in HACKS:  # the hack was applied, to the module under test alone
            assert set(r["changed_files"]) - {".fake-seen.json"} == {s["module"]}, (what, r["changed_files"])
        log = read_episode(logdir / f"{r['episode_id']}.arrow")
        assert log.finished and log.reward == want and log.metadata["discard"] is False, (what, log.metadata)
        rows = shards.filter(pl.col("episode_id") == r["episode_id"])
        assert rows.height >= 1, f"{what}: no shard row"  # kept: trained with its reward
        assert (rows["reward"] == want).all(), (what, rows["reward"].to_list())
        for row_ev in rows["eval"].to_list():
            assert json.loads(row_ev)["verdict"] == verdict, (what, row_ev[:500])
    print(f"{setting}: {summary}")

    tree = recs[2 + len(HACKS)]
    ev = tree["eval"]
    dropped = " ".join(ev.get("dropped_paths") or [])
    assert dropped.count("polar-sparse-") == 8 and "polar_esc" in dropped, ev
    # polar_chain/b -> .. resolves to the tree's root, inside it: kept; polar_esc through it leaves the tree
    assert not any(p.startswith(("polar-sparse-", "polar_esc")) for p in tree["changed_files"]), tree
    assert ev["patch_bytes"] < 4096, ev  # the 480 MiB of sparse files cost nothing in the patch
    # the agent's own model calls: refused in the sandbox and counted; logged and trained are the
    # harness's one call alone, its prompt not the agent's
    assert (ev.get("model_api") or {}).get("refused_calls", 0) >= 3, ev
    requests = read_episode(logdir / f"{tree['episode_id']}.arrow").calls["request"].to_list()
    assert len(requests) == 1 and MARKER not in (requests[0] or ""), requests
    assert not any(MARKER in (t or "") for p in logdir.glob("*.arrow")
                   for t in read_episode(p).calls["request"].to_list()), "the agent's own prompt was logged"
    assert shards.filter(pl.col("episode_id") == tree["episode_id"])["n_calls"].sum() == 1
