"""Compaction triggered for real in the CLIs that have it, through the proxy, against polar-serve.

Each CLI runs the fix-add task with its own compaction threshold turned down (a copy of the bundled
recipe with the setting changed, the pinned lock file beside it) and
tests/fixtures/scripts/compaction.json: a long listing first, so the history outgrows the threshold,
then the fix, the tests and the answer, each reply picked by what the conversation holds (a
compaction rewrites the history, so the turn index cannot pick them). Each test shows:

- the compaction happened: the CLI's summary call is in the log, and a later agent call resends a
  history in which the summary replaced earlier turns (its prompt is shorter than the one before);
- how reconstruction splits it: the call after the compaction starts a new segment (FORK: no earlier
  row extends to its rewritten context), the summary call is its own segment or auxiliary, per the
  recipe's documented choice;
- every trained token is the sampled one in the context the server saw (`build --check`, the
  fidelity checks), and the coverage ledger closes.

The CLIs this machine cannot make compact are listed in COMPACTION in harness_recipes/compat.py
with the reason; docs/compatibility.md shows both.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness_recipes.compat import COMPACTION
from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.recipes.install import ensure_installed, lock_file
from harness_recipes.recipes.recipe import bundled_path, load_recipe
from polar_recon.cli import main as recon_main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "compaction.json"
SUMMARY = "COMPACTION-SUMMARY"  # in every scripted summary reply (the script's rules)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.support.servers import tiny_model_dir
    logdir = tmp_path_factory.mktemp("logs")
    with serve(tiny_model_dir(), script=SCRIPT) as srv, capture_proxy(srv.url, logdir) as proxy:
        yield proxy, logdir


def lowered_recipe(name: str, where: Path) -> Path:
    """The bundled recipe with its compaction setting turned down (COMPACTION[name].settings: the
    recipe's text with each (old, new) replaced once), its lock file beside it, so the install
    is the pinned one already in the cache."""
    text = bundled_path(name).read_text()
    for old, new in COMPACTION[name].settings:
        assert text.count(old) == 1, f"{name}: the recipe no longer has {old!r} exactly once"
        text = text.replace(old, new)
    path = where / f"{name}.toml"
    path.write_text(text)
    lock = lock_file(load_recipe(name))
    if lock is not None:
        shutil.copyfile(lock, where / lock.name)
    return path


def messages_text(request: str) -> str:
    return json.dumps(json.loads(request))


@pytest.mark.parametrize("name", [n for n, c in sorted(COMPACTION.items()) if c.settings])
def test_the_cli_compacts_and_the_rows_stay_faithful(name, stack, tmp_path):
    from harness_recipes.tasks.samples import sample_task_file
    proxy, logdir = stack
    recipe = lowered_recipe(name, tmp_path)
    ensure_installed(load_recipe(recipe))
    tasks = sample_task_file(tmp_path, f"compact-{name}")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", str(recipe), "--tasks", str(tasks),
         "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir),
         "--out", str(out), "--no-progress", "--recon", "none"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    assert rec["status"] == "done" and rec["reward"] == 1.0, f"{rec}\n{proxy.output()[-3000:]}"

    from polar_contracts.log.arrays import read_calls
    from polar_contracts.log.reader import read_episode
    from polar_recon.diagnostics import inspect_rows
    from polar_recon.tokens import DEFAULT_TOKENIZER, TurnMarkers
    path = logdir / f"{rec['episode_id']}.arrow"
    rows = list(read_episode(path).calls.iter_rows(named=True))
    shape = [(r["call_index"], len(r["prompt_ids"] or ()), len(r["completion_ids"] or ()), r["auxiliary"],
              (r["error"] or "")[:80]) for r in rows]  # (call, prompt, completion, auxiliary, error): for failures
    for r in rows:
        assert r["error"] is None and r["prompt_ids"] and r["completion_ids"], shape
    # the CLI's own summary call: its request carries the CLI's compaction instruction
    summary_calls = [r["call_index"] for r in rows if re.search(COMPACTION[name].summary_request, r["request"])]
    assert summary_calls, f"{name}: no summary call: {shape}"
    s = summary_calls[0]
    # the rewritten history: a later agent call resends the summary, with a shorter prompt than the
    # last agent call before the compaction
    before = [r for r in rows if r["call_index"] < s and r["call_index"] not in summary_calls
              and not r["auxiliary"]]  # (agent calls: not Gemini CLI's next-speaker check)
    after = [r for r in rows if r["call_index"] > s and r["call_index"] not in summary_calls
             and SUMMARY in messages_text(r["request"])]  # (not Gemini CLI's verify call: it resends the summary too)
    assert before and after, f"{name}: no call resent the summary: {shape}"
    assert len(after[0]["prompt_ids"]) < len(before[-1]["prompt_ids"])
    ep = read_calls(path)
    view = {v["call"]: v for v in inspect_rows(ep, TurnMarkers.load(DEFAULT_TOKENIZER))}
    assert view[after[0]["call_index"]]["link"] == "FORK", view[after[0]["call_index"]]
    assert view[after[0]["call_index"]]["segment"] != view[before[-1]["call_index"]]["segment"]
    want_aux = COMPACTION[name].summary == "auxiliary"
    for c in summary_calls:
        assert (view[c]["link"] == "AUX") == want_aux, (name, view[c])

    # rows: token-faithful (build --check re-verifies every row against the served prompts) and the
    # ledger closes, with the summary calls' tokens where the recipe's choice puts them
    shards = tmp_path / "shards"
    b = CliRunner().invoke(recon_main, ["build", str(logdir), str(shards), "--check", "--group-by", "episode"])
    assert b.exit_code == 0 and "100.0% accounted for" in b.output, b.output
    led = json.loads((shards / ".polar-recon-manifest.json").read_text())["ledger"][rec["episode_id"]]
    # (the auxiliary rows: the summary calls when the recipe flags them, and any other call capture
    # or the recipe flags, such as Gemini CLI's next-speaker checks)
    assert all(r["auxiliary"] == want_aux for r in rows if r["call_index"] in summary_calls), shape
    aux_tokens = sum(len(r["completion_ids"]) for r in rows if r["auxiliary"])
    assert led["excluded"].get("auxiliary", 0) == aux_tokens
    assert led["trained"] + sum(led["excluded"].values()) == led["sampled"]
