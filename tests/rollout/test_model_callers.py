"""Only the harness talks to the model, with every bundled recipe's real CLI (local + bubblewrap).

polar-serve (scripted) behind the capture proxy: the model's first turn asks the harness's shell tool
to call the model itself (curl, then python's urllib, to the sandbox's forwarder port, the one the
harness uses); the harness then calls again with that command's output. Checked from outside: the
harness's own calls are in the log (it could call, before and after), the command's output it sent
back holds the forwarder's refusal (polar_model_api_refused), and the episode's eval metadata
counts the refusals. aider has no shell tool (its model answers with edit blocks): only its own
calls are checked. Recipes whose CLI is not in the harness cache are skipped, saying so
(`make harnesses` installs them); POLAR_MODEL_CALLER_RECIPES=a,b runs only those.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.recipes.install import bin_path
from harness_recipes.recipes.recipe import bundled_names, load_recipe
from harness_recipes.runtimes.api_socket import INNER_PORT
from harness_recipes.runtimes.local import bwrap_available
from polar_contracts.log.reader import read_episode
from tests.support.servers import tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
SHELLS = ["run_shell_command", "bash", "shell", "exec_command", "Bash"]
URL = f"http://127.0.0.1:{INNER_PORT}/v1/chat/completions"
BODY = '{"model": "polar-model", "messages": [{"role": "user", "content": "chosen by the agent"}], "max_tokens": 4}'
PY_CALL = (f"import urllib.request as u; r = u.Request('{URL}', data=b'{{}}', "
           "headers={'Content-Type': 'application/json'}); print('urllib', u.urlopen(r, timeout=10).status)")
# curl, then python's urllib (an HTTP 403 raises: its traceback names it), as a shell tool runs them
COMMAND = f"curl -s -m 10 -H 'Content-Type: application/json' -d '{BODY}' {URL}; echo; python3 -c \"{PY_CALL}\""


def script(tmp_path: Path) -> Path:
    p = tmp_path / "model-call-script.json"
    p.write_text(json.dumps({
        "description": "the agent calls the model from its shell tool, then stops",
        "turn_index": "assistant_after_last_user",
        "rules": [
            {"when": {"tools": False, "system_contains": "SEARCH/REPLACE"}, "reply": {"content": "Nothing to change."}},
            {"when": {"tools": False}, "reply": {"content": "Model call"}},
            {"when": {"any_contains": "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "turn": 1},
             "reply": {"tool_calls": [{"tool": "bash",
                                       "arguments": {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}}]}},
        ],
        "turns": [{"content": "Calling the model myself.",
                   "tool_calls": [{"tool": {"any_of": SHELLS}, "arguments": {"command": COMMAND}}]}],
        "fallback": {"content": "Done."},
    }))
    return p


def recipes() -> list[str]:
    wanted = os.environ.get("POLAR_MODEL_CALLER_RECIPES")
    return [n for n in wanted.split(",") if n] if wanted else bundled_names()


@pytest.mark.parametrize("name", recipes())
def test_the_harness_calls_and_its_shell_commands_do_not(tmp_path, name):
    if not bwrap_available():
        pytest.skip("bubblewrap cannot create namespaces here: the forwarder runs only in a sandbox")
    recipe = load_recipe(name)
    if recipe.install.kind != "none" and not bin_path(recipe).exists():
        pytest.skip(f"{name}: its CLI is not in the harness cache ({bin_path(recipe)}); `make harnesses` installs it")
    task = json.loads((REPO / "data" / "tasks" / "tasks.jsonl").read_text().splitlines()[0])
    task.update(id="model-call", workspace=str(REPO / "data" / "tasks" / task["workspace"]))
    task.pop("script", None)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(task) + "\n")
    logdir, out = tmp_path / "logs", tmp_path / "out"
    with serve(tiny_model_dir(), script=script(tmp_path)) as srv, capture_proxy(srv.url, logdir) as proxy:
        r = subprocess.run([sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", name, "--tasks", str(tasks),
                            "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir",
                            str(logdir), "--out", str(out), "--no-progress", "--recon", "none"],
                           capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    log = read_episode(logdir / f"{rec['episode_id']}.arrow")
    requests = [t for t in log.calls["request"].to_list() if t]
    assert requests and all(s == 200 for s in log.calls["status"].to_list()), (rec, log.calls)
    if name == "aider":
        return  # no shell tool: its own calls passed, which is all there is to check
    # the harness called again after its shell command, with the command's output: the forwarder's refusal
    assert len(requests) >= 2, (rec.get("harness_stderr_tail"), requests)
    relayed = [t for t in requests if "polar_model_api_refused" in t]
    assert relayed, (rec.get("harness_stderr_tail"), requests[-1][-3000:])
    refused = rec["eval"]["model_api"]
    assert refused["refused_calls"] >= 1 and refused["refused_peers"] == 0, refused


def test_model_callers_are_checked_at_load(tmp_path):
    from harness_recipes.recipes.recipe import RecipeError, parse_recipe
    base = {"name": "x", "api": "chat", "install": {"kind": "none", "bin": "x"}, "episode": {"via": "header"},
            "run": {"argv": ["x"]}}
    assert parse_recipe(base, tmp_path / "x.toml").model_callers == ()
    ok = parse_recipe({**base, "run": {"argv": ["x"], "model_callers": ["codex"]}}, tmp_path / "x.toml")
    assert ok.model_callers == ("codex",)
    for bad in ("codex", ["a/b"], [""], [1]):
        with pytest.raises(RecipeError, match=r"\[run\].model_callers"):
            parse_recipe({**base, "run": {"argv": ["x"], "model_callers": bad}}, tmp_path / "x.toml")
    assert load_recipe("codex").model_callers == ("codex",) and load_recipe("pi").model_callers == ()
