"""The reconstruction property test: harness-like episodes (earlier turns edited, tool arguments rewritten,
sliding windows over identical turns, compaction, sub-agents with identical prompts, n>1, retries,
thinking dropped) sent through the REAL mitmdump + addon to polar-serve (scripted: the content is
controlled, the tokens and logprobs are the server's), then `polar-recon build --check`, then on
every row: the context before each trainable completion is the prompt that call was served, up to
named re-render classes (item 1), and every choice of every call is trained in exactly one row or
excluded with a reason (item 2). One mitmdump and one polar-serve per module.

POLAR_E2E_PROPERTY_EXAMPLES sets the number of episodes (default 25: about a minute on 2 cores)."""
from __future__ import annotations

import copy
import itertools
import json
import os
import shutil

import httpx
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_contracts.log.arrays import read_calls
from polar_contracts.shards import MANIFEST
from polar_recon.build import Options, build
from polar_recon.fidelity import check_sequences
from polar_recon.link import FORK, link_calls
from polar_recon.strategies import token_sequences
from polar_recon.tokens import TurnMarkers
from tests.addon.procs import mitmdump
from tests.support.servers import polar_serve, tiny_model_dir

EXAMPLES = int(os.environ.get("POLAR_E2E_PROPERTY_EXAMPLES", "25"))
M = TurnMarkers.load()

SHELL = {"tool": "run_shell", "arguments": {"command": "ls"}}
WRITE = {"tool": "write_file", "arguments": {"path": "a.txt", "content": "hi"}}
# reply k answers a request whose last user message holds "R<k>"
REPLIES = [
    {"reasoning": "I should look first.", "tool_calls": [SHELL]},
    {"content": "Writing it.", "tool_calls": [WRITE]},
    {"reasoning": "All checked.", "content": "All done."},
    {"content": "ok"},
    {"reasoning": "Two at once.", "tool_calls": [SHELL, WRITE]},
    {"tool_calls": [SHELL]},
]
TOOLS = [
    {"type": "function", "function": {"name": "run_shell", "description": "Run a shell command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}},
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    work = tmp_path_factory.mktemp("prop-e2e")
    script = work / "script.json"
    script.write_text(json.dumps({
        "rules": [{"when": {"last_user_contains": f"R{k}"}, "reply": r} for k, r in enumerate(REPLIES)],
        "fallback": {"content": "Done."}}))
    logdir = work / "logs"
    with polar_serve(tiny_model_dir(), "vllm", script=script) as srv:
        with mitmdump(work, logdir, upstream=srv.base_url, sets={"polar_dialect": "auto"}) as px:
            model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
            with httpx.Client(timeout=120) as client:
                yield work, logdir, px.url, model, client


def _habit(msg: dict, harness: str) -> dict:
    """How the harness sends the assistant message back."""
    out = {"role": "assistant", "content": msg.get("content")}
    reasoning = msg.get("reasoning_content", msg.get("reasoning"))
    if msg.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])}
                             for c in msg["tool_calls"]]
    if harness == "strict" and reasoning is not None:
        out["reasoning_content"] = reasoning
    if harness == "qwen-code":  # drops reasoning, compact JSON arguments
        for c in out.get("tool_calls", []):
            c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))
    if harness == "tidy" and out["content"] is not None and not out["content"].strip():
        out["content"] = None
    return out


step = st.one_of(
    st.tuples(st.just("user"), st.integers(0, len(REPLIES) - 1)),
    st.tuples(st.just("tool"), st.sampled_from(["ok", "ok", "x\ny"])),  # identical "ok" results are common
    st.tuples(st.just("retry")),
    st.tuples(st.just("n2")),
    st.tuples(st.just("slide")),
    st.tuples(st.just("compact")),
    st.tuples(st.just("edit")),
    st.tuples(st.just("rewrite")),
    st.tuples(st.just("subagents"), st.integers(0, len(REPLIES) - 1)),
)
_ids = itertools.count()


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(harness=st.sampled_from(["strict", "qwen-code", "tidy"]), thinking=st.booleans(),
       first=st.integers(0, len(REPLIES) - 1), steps=st.lists(step, min_size=1, max_size=6))
def test_harness_episodes_through_the_proxy(stack, harness, thinking, first, steps):
    work, logdir, url, model, client = stack
    ep = f"prop-{next(_ids)}"
    edited = []  # call indices whose request changed an earlier assistant turn: must not extend it

    def call(messages, n=1):
        body = {"model": model, "messages": messages, "tools": TOOLS, "stream": False, "max_tokens": 64,
                "chat_template_kwargs": {"enable_thinking": thinking}}
        if n > 1:
            body["n"] = n
        r = client.post(url + "/v1/chat/completions", json=body, headers={"x-polar-episode": ep})
        assert r.status_code == 200, r.text[:500]
        return r.json()["choices"]

    calls = 0
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": f"R{first}"}]
    last = call(msgs)[0]["message"]
    calls += 1
    for s in steps:
        kind = s[0]
        msgs.append(_habit(last, harness))
        if kind == "user" or (kind == "tool" and not last.get("tool_calls")):
            msgs.append({"role": "user", "content": f"R{s[1] if kind == 'user' else 3}"})
        elif kind == "tool":
            for c in last["tool_calls"]:
                msgs.append({"role": "tool", "tool_call_id": c["id"], "content": s[1]})
        elif kind == "retry":  # the harness rejects the answer and asks again
            msgs.pop()
            call(msgs)
            calls += 1
            continue
        elif kind == "n2":
            msgs.pop()
            last = call(msgs, n=2)[1]["message"]  # the harness continues with the second choice
            calls += 1
            continue
        elif kind == "slide":  # drop the oldest exchange after the task
            msgs.append({"role": "user", "content": "R5"})
            if len(msgs) > 5:
                del msgs[2:4]
        elif kind == "compact":
            msgs = [msgs[0], {"role": "user", "content": "Summary of the work so far. R0"}]
        elif kind == "edit":  # an earlier assistant message edited
            msgs[-1]["content"] = (msgs[-1].get("content") or "") + " (edited)"
            msgs.append({"role": "user", "content": "R2"})
            edited.append(calls)
        elif kind == "rewrite":  # an earlier tool call's arguments rewritten ("hi" -> "bye")
            if msgs[-1].get("tool_calls"):
                f = msgs[-1]["tool_calls"][0]["function"]
                a = json.loads(f["arguments"])
                f["arguments"] = json.dumps({k: ("bye" if v in ("hi", "ls") else v) for k, v in a.items()})
                edited.append(calls)
            msgs.append({"role": "user", "content": "R2"})
        elif kind == "subagents":  # two sub-agents with identical prompts, each one step on
            sub = [{"role": "system", "content": "You are a sub-agent."}, {"role": "user", "content": f"R{s[1]}"}]
            for _ in range(2):
                m = call(copy.deepcopy(sub))[0]["message"]
                call(sub + [_habit(m, harness), {"role": "user", "content": "R3"}])
                calls += 2
            msgs.pop()
            continue
        last = call(msgs)[0]["message"]
        calls += 1
    r = client.post(f"{url}/polar/{ep}/end", json={"reward": 1.0, "metadata": {"harness": harness}})
    assert r.status_code == 200, r.text

    # build this episode alone, with the fidelity check on (a failing episode is a build error)
    one = work / ep
    (one / "logs").mkdir(parents=True)
    shutil.copy(logdir / f"{ep}.arrow", one / "logs" / f"{ep}.arrow")
    report = build(one / "logs", one / "out", Options(check=True))
    assert not report.errors, report.errors

    episode = read_calls(one / "logs" / f"{ep}.arrow")
    n_choices = 1 + sum({"n2": 2, "subagents": 4}.get(s[0], 1) for s in steps)
    assert len(episode.calls) == n_choices  # every choice recorded by the proxy
    nodes = link_calls(episode.calls, M)
    excluded: list = []
    seqs = token_sequences(episode, M, nodes, excluded=excluded)
    assert check_sequences(episode, seqs, excluded, M) == []  # items 1 and 2, on every row
    for k in edited:  # the call whose request edits call k-1's answer never extends call k-1
        node = next(n for n in nodes if n.call.call_index == k)
        assert node.kind == FORK or nodes[node.parent].call.call_index != k - 1, (node.kind, node.note)
    # the shards hold exactly these rows, with the fidelity and termination columns
    rows = [r for p in sorted((one / "out").glob("shard-*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert len(rows) == len([s for s in seqs if s.loss_mask.any()])
    assert sorted((r["realign_tokens"], tuple(r["realign_classes"])) for r in rows) == sorted(
        (s.realign_tokens, tuple(s.realign_classes)) for s in seqs if s.loss_mask.any())
    assert all(r["termination"] in ("stop", "length") for r in rows)
    manifest = json.loads((one / "out" / MANIFEST).read_text())
    assert sum(manifest["excluded_counts"].values()) == len(excluded)
