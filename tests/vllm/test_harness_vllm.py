"""Real harness CLIs through mitmdump + the Polar addon + the REAL vLLM, scripted by forcing.

    harness -> mitmdump + addon -> forced_replies shim -> vLLM 0.32 (+ ForcedReply logits processor)

The shim picks each reply from data/tasks/scripts/fix_tasks.json (polar_serve/script.py, as in
polar-serve's scripted mode) and passes its token ids as `vllm_xargs.polar_forced`; vLLM samples
them under the processor. Pi, Qwen Code and OpenCode speak chat completions, Codex the Responses
API, Gemini CLI the Gemini API (the addon translates both to chat upstream). Each run must fix
the task (reward 1.0), every captured call's completion ids must be exactly the ids the shim
forced (the random model never produces them by itself), with the
model's own (raw, unforced) logprobs, and polar-recon must build the shards. The vLLM here is the
module's stock one (tests/conftest.py, `stock_vllm`: vLLM's default raw_logprobs mode; in processed
mode the forced tokens' logprobs would be the one-hot's 0.0), the plugin loaded through
VLLM_EXTRA_ARGS / VLLM_ENV.
"""
from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from harness_recipes.demo.scripted_vllm import forced_replies
from harness_recipes.node.local_stack import capture_proxy
from harness_recipes.recipes.install import ensure_installed
from harness_recipes.recipes.recipe import load_recipe
from harness_recipes.tasks.samples import sample_task_file
from tests.conftest import VLLM_MODEL_NAME

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "data" / "tasks"
SCRIPT = TASKS / "scripts" / "fix_tasks.json"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.fixture(scope="module")
def shim(stock_vllm, tiny_model, tmp_path_factory):
    work = tmp_path_factory.mktemp("forced")
    record = work / "forced.jsonl"
    record.touch()
    with forced_replies(stock_vllm.url, tiny_model, SCRIPT, record=record, log=work / "shim.log") as p:
        p.record = record
        yield p


def records(shim) -> list[dict]:
    return [json.loads(x) for x in shim.record.read_text().splitlines()]


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_vllm_samples_the_forced_reply(shim, stock_vllm):
    """Direct (no proxy): the answer's token ids are the forced ids, parsed by vLLM's own hermes
    tool parser and qwen3 reasoning parser; logprobs are the model's unforced ones; streams too."""
    body = {"model": VLLM_MODEL_NAME, "messages": [{"role": "user", "content": "Fix calc.py please."}],
            "tools": TOOLS, "return_token_ids": True, "logprobs": True, "top_logprobs": 2}
    n = len(records(shim))
    status, raw = post(shim.url + "/v1/chat/completions", body)
    assert status == 200, raw[:2000]
    out = json.loads(raw)
    (rec,) = records(shim)[n:]
    assert rec["source"] == "rule 6" and rec["ids"][-1] == 151645  # the calc.py turn-0 rule; <|im_end|>
    choice = out["choices"][0]
    assert choice["token_ids"] == rec["ids"] and choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "bash"
    assert json.loads(call["function"]["arguments"]) == {"command": "sed -i 's/return a - b/return a + b/' calc.py"}
    assert choice["message"]["reasoning"].strip() == "The add function subtracts. I will fix it with sed."
    lps = [e["logprob"] for e in choice["logprobs"]["content"]]
    # raw logprobs: the random model's own (about -log(151936) = -11.9), not the forced one-hot's 0.0
    assert len(lps) == len(rec["ids"]) and all(-30 < lp < -1 for lp in lps)

    status, raw = post(shim.url + "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    ids = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                ids += c.get("token_ids") or []
    assert ids == records(shim)[-1]["ids"] == rec["ids"]

    # the processor leaves requests without the key alone: vLLM samples them (not the script's reply)
    status, raw = post(stock_vllm.url + "/v1/chat/completions", {**body, "max_tokens": 8, "seed": 1})
    assert status == 200 and json.loads(raw)["choices"][0]["token_ids"] != rec["ids"][:8]
    # a malformed forced sequence is vLLM's 400 (ForcedReply.validate_params)
    status, raw = post(stock_vllm.url + "/v1/chat/completions", {**body, "vllm_xargs": {"polar_forced": ["x"]}})
    assert status == 400, raw[:500]
    # a script tool the request does not declare: 400 from the shim, as polar-serve answers it
    status, raw = post(shim.url + "/v1/chat/completions", {**body, "tools": [{**TOOLS[0], "function": {
        **TOOLS[0]["function"], "name": "other"}}]})
    assert status == 400 and b"declares tools" in raw


def test_the_probe_says_raw_for_a_stock_vllm(stock_vllm):
    """vLLM's default logprobs (raw_logprobs) are told apart from processed ones (the session's
    server, tests/vllm/test_logprobs_mode.py) by the addon's probe."""
    from addon.logprobs_probe import probe_upstream

    assert probe_upstream(stock_vllm.url, VLLM_MODEL_NAME) == "raw"


@pytest.fixture(scope="module")
def proxy(shim, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("logs")
    # (the mode is known: the probe's own requests would be scripted by the shim and counted among
    # the forced replies; test_the_probe_says_raw_for_a_stock_vllm probes this server directly)
    with capture_proxy(shim.url, logdir, sets={"polar_logprobs_mode": "raw"}) as p:
        p.logdir = logdir
        yield p


# Gemini CLI speaks the Gemini API (translated to chat by the addon); OpenCode chat completions.
NEW = ("gemini-cli", "opencode")


@pytest.mark.parametrize("harness", ["pi", "codex", "qwen-code", *NEW])
def test_real_harness_on_real_vllm(shim, proxy, tmp_path, harness):
    ensure_installed(load_recipe(harness))
    out, tag = tmp_path / "out", f"{harness}-vllm"
    n = len(records(shim))
    proc = subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", harness,
         "--tasks", str(sample_task_file(tmp_path, tag)), "--proxy", proxy.url,
         "--control-secret-file", str(proxy.secret_file), "--logdir", str(proxy.logdir),
         "--out", str(out), "--no-progress", "--recon", "build"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    detail = f"{rec}\nproxy output:\n{proxy.output()[-3000:]}"
    assert rec["status"] == "done" and rec["harness_rc"] == 0, detail
    assert "calc.py" in rec["changed_files"] and rec["reward"] == 1.0, detail

    from polar_contracts.log.reader import read_episode
    log = read_episode(proxy.logdir / f"{rec['episode_id']}.arrow")
    assert log.finished and log.reward == 1.0 and log.metadata["group_id"] == f"fix-add-{tag}"
    forced = records(shim)[n:]
    calls = list(log.calls.iter_rows(named=True))
    assert rec["n_calls"] == len(calls) == len(forced), (len(calls), [f["source"] for f in forced])
    # every call's completion is what vLLM sampled under the processor: exactly the forced ids
    assert sorted(r["completion_ids"] for r in calls) == sorted(f["ids"] for f in forced)
    sources = {tuple(f["ids"]): f["source"] for f in forced}
    # (OpenCode's first call asks for a session title, without tools: the script's rule 3 answers it)
    agent = [r for r in calls if not r["auxiliary"] and sources[tuple(r["completion_ids"])] != "rule 3"]
    assert len(agent) >= 3, "expected fix, test and final-answer calls"
    assert [sources[tuple(r["completion_ids"])] for r in agent][:2] == ["rule 6", "rule 7"]  # fix, then test
    errors = [(r["call_index"], r["error"], len(r["completion_ids"])) for r in calls if r["error"] is not None]
    for r in calls:
        assert r["status"] == 200
        assert r["prompt_ids"] and len(r["completion_logprobs"]) == len(r["completion_ids"])
        assert all(-30 < lp < -1 for lp in r["completion_logprobs"])  # the model's raw logprobs
        assert r["logprobs_mode"] == "raw"

    import polars as pl
    df = pl.read_parquet(out / "shard-*.parquet").filter(pl.col("episode_id") == rec["episode_id"])
    assert df.height >= 1
    for row in df.iter_rows(named=True):
        assert len(row["input_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
        assert sum(row["loss_mask"]) > 0 and row["reward"] == 1.0 and row["group_id"] == f"fix-add-{tag}"
    assert not errors, (errors, len(calls))
    if harness in NEW:
        # the token view: reconstruction followed the agent's turns, each call extending the one before
        from polar_contracts.log.arrays import read_calls
        from polar_recon.diagnostics import inspect_rows
        from polar_recon.tokens import DEFAULT_TOKENIZER, TurnMarkers
        view = {r["call"]: r for r in inspect_rows(read_calls(proxy.logdir / f"{rec['episode_id']}.arrow"),
                                                   TurnMarkers.load(DEFAULT_TOKENIZER))}
        idx = [r["call_index"] for r in agent]
        for a, b in zip(idx, idx[1:]):
            assert view[b]["link"] in ("CLEAN", "REALIGN") and view[b]["parent"] == a, view[b]
        assert len({view[i]["segment"] for i in idx}) == 1

