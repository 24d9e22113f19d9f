"""Shard side of docs/reconstruction.md: context fidelity, every sample accounted for, termination and
max length. Episodes are rendered with the real Qwen3 chat template (polar_recon.testing)."""
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from polar_contracts.log.arrays import read_calls
from polar_contracts.shards import MANIFEST
from polar_recon.build import Options, build
from polar_recon.fidelity import check_row, check_sequences
from polar_recon.link import CLEAN, FORK, REALIGN, link_calls
from polar_recon.rerender import CLASSES, classify
from polar_recon.strategies import per_call_sequences, token_sequences

from . import logs as L
from .test_link import M


def built(path, **kw):
    ep = read_calls(path)
    nodes = link_calls(ep.calls, M, exclude_retries=kw.pop("exclude_retries", False))
    excluded = []
    seqs = token_sequences(ep, M, nodes, excluded=excluded, **kw)
    assert check_sequences(ep, seqs, excluded, M) == []
    return ep, nodes, seqs, excluded


# --- the classes, on text --------------------------------------------------------------------

@pytest.mark.parametrize("old,new,want", [
    ("\n<think>\nR\n</think>\n\nHi<|im_end|>", "\nHi<|im_end|>", {"thinking-dropped"}),
    # vLLM's content keeps the "\n\n" after </think>; resent without the think block it renders raw
    ("\n<think>\n\n</think>\n\nHi<|im_end|>", "\n\n\nHi<|im_end|>", {"empty-thinking-dropped", "leading-newlines"}),
    ("\n<think>R</think>\n\nHi<|im_end|>", "\n<think>\nR\n</think>\n\nHi<|im_end|>", {"think-newlines"}),
    ('\n\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>',
     '\n\n\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>', {"whitespace-content"}),
    ('\n\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>',
     '\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>', {"null-content"}),
    ('\nOk<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>',
     '\nOk\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>', {"tool-call-newline"}),
    ('\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>',
     '\n<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call><|im_end|>', {"tool-arguments-reserialized"}),
    ("\nHi there", "\nHi there<|im_end|>", {"closed-by-template"}),
])
def test_known_classes(old, new, want):
    got = classify(old, new)
    assert got == want and got <= set(CLASSES)


@pytest.mark.parametrize("old,new", [
    ("\nI will write hi.<|im_end|>", "\nI will write bye.<|im_end|>"),  # an edited message
    ('\n<tool_call>\n{"name": "w", "arguments": {"content": "hi"}}\n</tool_call><|im_end|>',
     '\n<tool_call>\n{"name": "w", "arguments": {"content": "bye"}}\n</tool_call><|im_end|>'),  # rewritten arguments
    ('\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call><|im_end|>',
     '\n<tool_call>\n{"name": "v", "arguments": {}}\n</tool_call><|im_end|>'),  # another tool
    ("\nDone.<|im_end|>", "\n<think>\ninvented\n</think>\n\nDone.<|im_end|>"),  # reasoning never sampled
    ("\n<think>\nA\n</think>\n\nx<|im_end|>", "\n<think>\nB\n</think>\n\nx<|im_end|>"),  # edited reasoning
    ("\nHi  <|im_end|>", "\nHi<|im_end|>"),  # trimmed content: not a template habit
])
def test_other_changes_are_not_realigned(old, new):
    assert classify(old, new) is None


# --- through the real template ----------------------------------------------------------------

def test_edited_assistant_message_forks(tmp_path):
    def run(c):
        c.call(L.Sample("", "I will write hi.", [L.write_tool()]), results=["ok"])
        c.call(L.Sample("", "Check.", [("run_shell", json.dumps({"command": "ls"}))]), results=["hello.txt"])
        c.messages[2]["content"] = "I will write bye."  # the harness edits an earlier assistant message
        c.call(L.Sample("", "Done.", []))
    L.episode(tmp_path, "e", run, harness="strict", thinking=False)
    ep, nodes, seqs, _ = built(tmp_path / "e.arrow")
    assert [n.kind for n in nodes][0::2] == [FORK, FORK] and nodes[1].kind in (CLEAN, REALIGN)
    assert len(seqs) == 2 and sorted(c for s in seqs for c in s.calls) == [0, 1, 2]


def test_rewritten_tool_arguments_fork(tmp_path):
    def run(c):
        c.call(L.Sample("", "", [L.write_tool(content="hi")]), results=["ok"])
        c.messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "hello.txt", "content": "bye"})
        c.call(L.Sample("", "Done.", []))
    L.episode(tmp_path, "e", run, harness="strict", thinking=False)
    ep, nodes, seqs, _ = built(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, FORK] and len(seqs) == 2


def test_thinking_dropped_is_counted(tmp_path):
    L.episode(tmp_path, "e", L.two_tool_turns, harness="qwen-code", thinking=True)
    ep, nodes, seqs, _ = built(tmp_path / "e.arrow")
    assert [n.kind for n in nodes] == [FORK, REALIGN, REALIGN] and len(seqs) == 1
    s = seqs[0]
    assert "thinking-dropped" in s.realign_classes and set(s.realign_classes) <= set(CLASSES)
    # the counted tokens are the row's context that the model was not served: at least the two think blocks
    think = L.encode("<think>\nI should write the file.\n</think>")
    assert s.realign_tokens >= len(think)
    # the per-call strategy is the exact baseline
    assert all(p.realign_tokens == 0 for p in per_call_sequences(ep))


def test_sliding_window_with_identical_turns(tmp_path):
    # identical turns and identical "ok" results; then the harness cuts the oldest exchange: the row of
    # the last call must hold exactly the turns the model was served (checked by check_sequences)
    def run(c):
        for _ in range(4):
            c.call(L.Sample("", "", [("run_shell", json.dumps({"command": "true"}))]), results=["ok"])
        del c.messages[2:4]  # sliding window: the first assistant turn and its result leave the history
        c.call(L.Sample("", "", [("run_shell", json.dumps({"command": "true"}))]), results=["ok"])
        c.call(L.Sample("", "Done.", []))
    L.episode(tmp_path, "e", run, harness="strict", thinking=False)
    ep, nodes, seqs, _ = built(tmp_path / "e.arrow")
    assert sorted(c for s in seqs for c in s.calls) == list(range(6))
    last = next(s for s in seqs if 5 in s.calls)
    k = last.calls.index(5)
    ctx = last.input_ids[:last.starts[k]]
    # not a turn missing or extra: the same turns as served, differing at most by known re-renders
    assert np.count_nonzero(ctx == M.start) == np.count_nonzero(ep.calls[5].prompt == M.start)


def _choices(c, samples, keep=0, results=("ok",), finish_reason="stop"):
    """One call with n>1 choices (same call_index, choice 0..n-1); the harness continues with `keep`."""
    from polar_recon.testing import render

    prompt = L.encode(render(c.messages, c.tools, c.thinking))
    idx = c.w.next_call_index()
    for k, s in enumerate(samples):
        comp = L.encode(s.text(c.thinking))
        c.w.append_call(call_index=idx, choice=k, prompt_ids=prompt, completion_ids=comp,
                        completion_logprobs=[-0.5] * len(comp), api="chat", dialect="vllm", model="m", status=200,
                        stream=False, finish_reason=finish_reason, weight_version="1")
    c.messages.append(c.harness(samples[keep].parsed(c.thinking)))
    for r in results:
        c.messages.append({"role": "tool", "tool_call_id": "call_0", "content": r})


def test_n_choices_and_identical_siblings_all_train(tmp_path):
    def run(c):
        _choices(c, [L.Sample("", "", [L.write_tool()]), L.Sample("", "", [L.write_tool(content="other")])], keep=1)
        c.call(L.Sample("", "Done.", []))
    L.episode(tmp_path, "e", run, harness="strict", thinking=False)
    ep, nodes, seqs, excluded = built(tmp_path / "e.arrow")
    rows = sorted(r for s in seqs for r in s.call_rows)
    assert rows == sorted(c.row for c in ep.calls) and excluded == []
    # the harness used choice 1: that is the row that continues
    cont = next(s for s in seqs if len(s.call_rows) == 2)
    assert ep.calls[[c.row for c in ep.calls].index(cont.call_rows[0])].info["choice"] == 1
    # n>1 choices are never "rejected retries"
    assert built(tmp_path / "e.arrow", exclude_retries=True)[3] == []


def test_max_len_splits_at_call_boundaries_and_refuses_counted(tmp_path):
    # qwen-code drops the thinking it was sent: the row (sampled think blocks kept) is longer than any prompt
    L.episode(tmp_path, "e", L.two_tool_turns, harness="qwen-code", thinking=True)
    ep, _, full, _ = built(tmp_path / "e.arrow")
    assert len(full) == 1
    longest_call = max(len(c.prompt) + len(c.completion) for c in ep.calls)
    _, _, seqs, excluded = built(tmp_path / "e.arrow", max_len=longest_call)
    assert len(seqs) > 1 and all(len(s.input_ids) <= longest_call for s in seqs) and excluded == []
    _, _, seqs, excluded = built(tmp_path / "e.arrow", max_len=longest_call - 1)
    assert [r for _, r in excluded] == ["longer than max_len"]
    assert all(len(s.input_ids) <= longest_call - 1 for s in seqs)


def test_termination(tmp_path):
    def run(c):
        c.call(L.Sample("", "", [L.write_tool()]), results=["ok"])
        _choices(c, [L.Sample("", "Done and", [])], finish_reason="length", results=())
    L.episode(tmp_path, "a", run, harness="strict", thinking=False)
    L.episode(tmp_path, "b", lambda c: c.call(L.Sample("", "Hi.", [])), harness="strict", thinking=False,
              metadata={"status": "timeout"})
    L.episode(tmp_path, "c", lambda c: c.call(L.Sample("", "Hi.", [])), harness="strict", thinking=False)
    assert [s.termination for s in built(tmp_path / "a.arrow")[2]] == ["length"]
    assert [s.termination for s in built(tmp_path / "b.arrow")[2]] == ["timeout"]
    assert [s.termination for s in built(tmp_path / "c.arrow")[2]] == ["stop"]

    def two_rows(c):  # compaction: two rows; the episode timed out: both say so
        c.call(L.Sample("", "", [L.write_tool()]), results=["ok"])
        c.compact("wrote it")
        c.call(L.Sample("", "Done.", []))
    L.episode(tmp_path, "d", two_rows, harness="strict", thinking=False, metadata={"status": "timeout"})
    assert [s.termination for s in built(tmp_path / "d.arrow")[2]] == ["timeout", "timeout"]

    def cut_last(c):  # the last call cut at max_tokens: the earlier row is part of a truncated episode
        c.call(L.Sample("", "", [L.write_tool()]), results=["ok"])
        c.compact("wrote it")
        _choices(c, [L.Sample("", "Done and", [])], finish_reason="length", results=())
    L.episode(tmp_path, "f", cut_last, harness="strict", thinking=False)
    assert [s.termination for s in built(tmp_path / "f.arrow")[2]] == ["length", "length"]


def test_check_row_catches_a_wrong_context(tmp_path):
    L.episode(tmp_path, "e", L.two_tool_turns, harness="strict", thinking=False)
    ep, _, seqs, _ = built(tmp_path / "e.arrow")
    s = seqs[0]
    calls = [next(c for c in ep.calls if c.row == r) for r in s.call_rows]
    ids = s.input_ids.copy()
    user = int(np.flatnonzero(ids == M.start)[1]) + 3  # inside the task's user turn
    ids[user] = ids[user] + 1
    f = check_row(ids, s.loss_mask, s.logprobs, s.starts, calls, M)
    assert f.problems and "differs from the served prompt" in f.problems[0]


def test_build_records_columns_and_exclusions(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()

    def run(c):
        L.auxiliary_call(c.w)
        c.call(L.Sample("Plan.", "", [L.write_tool()]), results=["ok"])
        c.call(L.Sample("", "Hmm.", [("run_shell", json.dumps({"command": "x"}))]), keep=False)  # rejected retry
        c.call(L.Sample("", "Done.", [("run_shell", json.dumps({"command": "ls"}))]), results=["a"])
        c.call(L.Sample("", "Done.", []))
    L.episode(logs, "e", run, harness="qwen-code", thinking=True)
    r = build(logs, tmp_path / "out", Options(check=True))
    assert not r.errors and r.excluded_counts() == {"auxiliary": 1}
    t = pq.read_table(next((tmp_path / "out").glob("shard-*.parquet"))).to_pylist()
    assert len(t) == 2 and {row["termination"] for row in t} == {"stop"}
    assert any(row["realign_tokens"] > 0 and "thinking-dropped" in row["realign_classes"] for row in t)
    m = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert m["excluded_counts"] == {"auxiliary": 1}
    assert m["excluded_calls"]["e"] == [{"call": 0, "choice": 0, "reason": "auxiliary"}]
    r = build(logs, tmp_path / "out2", Options(check=True, exclude_rejected_retries=True))
    assert r.excluded_counts() == {"auxiliary": 1, "rejected retry": 1}


# --- the real recorded harness requests (tests/fixtures/harness-requests: Qwen Code, Pi) -----------

def _sampled(msg: dict, thinking: bool) -> str:
    """What Qwen3 emitted for a turn the harness sends back: reasoning in <think>, content, then each
    tool call in the hermes format with json.dumps arguments (the spacing the model writes)."""
    r = msg.get("reasoning_content") or ""
    s = f"\n<think>\n{r}\n</think>\n\n" if thinking else "\n"
    content = msg.get("content") or ""
    s += content
    for k, c in enumerate(msg.get("tool_calls") or []):
        args = json.dumps(json.loads(c["function"]["arguments"]))
        name = c["function"]["name"]
        s += ("\n" if (k or content) else "") + f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
    return s + "<|im_end|>"


@pytest.mark.parametrize("harness", ["qwen-code", "pi"])
def test_recorded_harness_turns_are_known_rerenders(harness):
    from polar_recon.testing import server_messages, tokenizer

    lines = (L.REPO / "tests" / "fixtures" / "harness-requests" / f"{harness}.jsonl").read_text().splitlines()
    body = json.loads(lines[-1])["body"]
    thinking = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
    text = tokenizer().apply_chat_template(server_messages(body["messages"]), tools=body.get("tools"), tokenize=False,
                                           add_generation_prompt=True, enable_thinking=thinking)
    served = [t.split("<|im_end|>")[0] + "<|im_end|>" for t in text.split("<|im_start|>assistant")[1:-1]]
    sent = [m for m in body["messages"] if m["role"] == "assistant"]
    assert served and len(served) == len(sent)
    for msg, new in zip(sent, served):
        old = _sampled(msg, thinking)
        got = classify(old, new)
        assert got is not None and got <= set(CLASSES), (old, new)
        if msg.get("content"):  # the same turn with its content edited is no re-render
            assert classify(old.replace(msg["content"], msg["content"] + " Also."), new) is None


def test_cli_max_len_model_and_stats(tmp_path):
    from click.testing import CliRunner

    from polar_recon.cli import main

    logs = tmp_path / "logs"
    logs.mkdir()
    L.episode(logs, "e", L.two_tool_turns, harness="qwen-code", thinking=True)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 50}))
    r = CliRunner().invoke(main, ["build", str(logs), str(tmp_path / "out"), "--model", str(model), "--check"])
    assert r.exit_code == 1 and "no usable call (longer than max_len)" in r.output, r.output  # all refused
    assert "sampled completions not trained (3; longer than max_len: 3)" in r.output
    r = CliRunner().invoke(main, ["build", str(logs), str(tmp_path / "out2"), "--check"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["stats", str(tmp_path / "out2"), "--json"])
    s = json.loads(r.output.strip().splitlines()[-1])
    assert s["context_divergent_tokens"] > 0 and "thinking-dropped" in s["realign_classes"]
    assert s["terminations"] == {"stop": 1} and s["excluded_counts"] == {}


def test_isolation_is_carried_from_the_end_metadata(tmp_path):
    """Every row says how its rollout confined the harness; an unsandboxed episode (--isolation none)
    is marked on each of its rows, and a rollout that did not say leaves the column null."""
    logs = tmp_path / "logs"
    logs.mkdir()

    def run(c):
        c.call(L.Sample("Plan.", "", [L.write_tool()]), results=["ok"])
        c.call(L.Sample("", "Done.", []))
    L.episode(logs, "open", run, harness="qwen-code", thinking=True, metadata={"isolation": "none"})
    L.episode(logs, "boxed", run, harness="qwen-code", thinking=True, metadata={"isolation": "bubblewrap"})
    L.episode(logs, "old", run, harness="qwen-code", thinking=True)
    r = build(logs, tmp_path / "out", Options(check=True))
    assert not r.errors
    rows = pq.read_table(next((tmp_path / "out").glob("shard-*.parquet"))).to_pylist()
    by_episode = {(row["episode_id"], row["isolation"]) for row in rows}
    assert by_episode == {("open", "none"), ("boxed", "bubblewrap"), ("old", None)}, by_episode


def test_control_plane_is_carried_from_the_end_metadata(tmp_path):
    """Every row says whether its proxy's control plane was secured; a run against an open proxy
    (polar-rollout run --unsafe-open-proxy) is marked on each row; an older rollout leaves null."""
    logs = tmp_path / "logs"
    logs.mkdir()

    def run(c):
        c.call(L.Sample("Plan.", "", [L.write_tool()]), results=["ok"])
        c.call(L.Sample("", "Done.", []))
    L.episode(logs, "open", run, harness="qwen-code", thinking=True, metadata={"control_plane": "open"})
    L.episode(logs, "secured", run, harness="qwen-code", thinking=True, metadata={"control_plane": "secured"})
    L.episode(logs, "old", run, harness="qwen-code", thinking=True)
    r = build(logs, tmp_path / "out", Options(check=True))
    assert not r.errors
    rows = pq.read_table(next((tmp_path / "out").glob("shard-*.parquet"))).to_pylist()
    got = {(row["episode_id"], row["control_plane"]) for row in rows}
    assert got == {("open", "open"), ("secured", "secured"), ("old", None)}, got
