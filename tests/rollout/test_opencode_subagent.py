"""OpenCode's sub-agents through the proxy: what reconstruction must handle.

The real OpenCode (recipe `opencode`) runs fix-add with a prompt asking it to delegate; polar-serve,
scripted by tests/fixtures/scripts/opencode_subagent.json, has the parent call its `task` tool, the
sub-agent (a fresh conversation, same episode) fix calc.py with bash and answer, and the parent
answer. The task must be fixed (reward 1.0), every call captured with ids, and reconstruction must
keep the two conversations apart: the sub-agent's first call is a FORK, each later call of either
conversation links to the call before it in its own conversation, and the shards hold one trained
segment per conversation.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.recipes.install import ensure_installed
from harness_recipes.recipes.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "fixtures" / "scripts" / "opencode_subagent.json"
PROMPT = ("SUBAGENT-DEMO: the test in test_calc.py fails. Delegate the fix of calc.py to a sub-agent with the "
          "task tool, then tell me what it did.")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.support.servers import tiny_model_dir
    logdir = tmp_path_factory.mktemp("logs")
    with serve(tiny_model_dir(), script=SCRIPT) as srv, capture_proxy(srv.url, logdir) as proxy:
        yield proxy, logdir


def last_user(request: str) -> str:
    msgs = [m for m in json.loads(request)["messages"] if m["role"] == "user"]
    c = msgs[-1]["content"] if msgs else ""
    return c if isinstance(c, str) else " ".join(p.get("text", "") for p in c)


def test_opencode_subagent_is_its_own_segment(stack, tmp_path):
    from harness_recipes.tasks.samples import sample_task_file
    proxy, logdir = stack
    ensure_installed(load_recipe("opencode"))
    tasks = sample_task_file(tmp_path, "opencode-subagent", id="opencode-subagent", prompt=PROMPT)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", "opencode", "--tasks", str(tasks),
         "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir),
         "--out", str(out), "--no-progress", "--recon", "build"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    detail = f"{rec}\nproxy output:\n{proxy.output()[-3000:]}"
    assert rec["status"] == "done" and rec["reward"] == 1.0, detail

    from polar_contracts.log.arrays import read_calls
    from polar_contracts.log.reader import read_episode
    from polar_recon.diagnostics import inspect_rows
    from polar_recon.tokens import DEFAULT_TOKENIZER, TurnMarkers
    path = logdir / f"{rec['episode_id']}.arrow"
    rows = list(read_episode(path).calls.iter_rows(named=True))
    for r in rows:
        assert r["error"] is None and r["prompt_ids"] and r["completion_ids"], r["error"]
    tooled = [r for r in rows if json.loads(r["request"]).get("tools")]
    sub = [r["call_index"] for r in tooled if "SUBTASK" in last_user(r["request"])]
    parent = [r["call_index"] for r in tooled if "SUBAGENT-DEMO" in last_user(r["request"])]
    assert len(sub) == 2 and len(parent) == 2, [(r["call_index"], last_user(r["request"])[:60]) for r in rows]
    assert parent[0] < sub[0] < sub[1] < parent[1]  # the parent waits for its sub-agent

    view = {r["call"]: r for r in inspect_rows(read_calls(path), TurnMarkers.load(DEFAULT_TOKENIZER))}
    assert view[parent[0]]["link"] == "FORK" and view[sub[0]]["link"] == "FORK"
    for a, b in (parent, sub):
        assert view[b]["link"] in ("CLEAN", "REALIGN") and view[b]["parent"] == a, view[b]
    assert view[parent[0]]["segment"] == view[parent[1]]["segment"] != view[sub[0]]["segment"] == \
        view[sub[1]]["segment"]

    import polars as pl
    df = pl.read_parquet(out / "shard-*.parquet").filter(pl.col("episode_id") == rec["episode_id"])
    segs = {s for s in df["segment"].to_list()}
    assert segs == {view[parent[0]]["segment"], view[sub[0]]["segment"]}
    # the session-title call (no tools) is flagged by the recipe's [[auxiliary]] rule: recorded, not trained
    titles = [r["call_index"] for r in rows if not json.loads(r["request"]).get("tools")]
    assert titles and all(view[c]["link"] == "AUX" for c in titles), [view[c] for c in titles]
    for row in df.iter_rows(named=True):
        assert sum(row["loss_mask"]) > 0 and row["reward"] == 1.0
