"""The capture proxy in front of the REAL vLLM 0.32 (CPU), chat and completions, table-driven.

For every case: the harness's bytes through the proxy equal the bytes of the same request sent
straight to vLLM, less only the per-call values (capture_support.VOLATILE: `id`, `created`); the
log row(s) hold the server's own prompt ids, completion ids and logprobs (asked from vLLM directly
with `return_token_ids` / `logprobs`); no row says success with other ids. Cases the proxy cannot
record exactly (CANNOT) must say so on the row, and the harness still gets the server's answer.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from .capture_support import (
    CHAT,
    COMPLETIONS,
    MODEL,
    assert_no_silent_wrong_row,
    assert_rows_match,
    assert_same_answer,
    differs_only_in_chunking,
    new_episode,
    post,
    stack,  # noqa: F401 - the module's fixture
    truth,
)

USER = {"role": "user", "content": "Please create hello.txt — ünïcode ok?"}
TOOLS = [
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file in the workspace.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
]


def _call(cid: str, name: str, args: dict) -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# A multi-turn tool history as a harness builds it (the random model never calls tools itself).
TURN1 = [{"role": "system", "content": "You are a coding agent."}, USER]
TURN2 = [*TURN1,
         {"role": "assistant", "content": None,
          "tool_calls": [_call("call_1", "write_file", {"path": "hello.txt", "content": "hi ✓"})]},
         {"role": "tool", "tool_call_id": "call_1", "content": "wrote 4 bytes"}]
TURN3 = [*TURN2,
         {"role": "assistant", "content": "Done.", "reasoning_content": "The file is written."},
         {"role": "user", "content": "Now read it back, and also hello2.txt."},
         {"role": "assistant", "content": "",
          "tool_calls": [_call("call_2", "read_file", {"path": "hello.txt"}),
                         _call("call_3", "read_file", {"path": "hello2.txt"})]},
         {"role": "tool", "tool_call_id": "call_2", "content": "hi ✓"},
         {"role": "tool", "tool_call_id": "call_3", "content": "error: no such file"}]

GREEDY = {"temperature": 0}
SEEDED = {"temperature": 1, "top_p": 1, "seed": 1234}  # n > 1 needs sampling; top_p < 1 is slow on CPU

CHAT_CASES = {
    "plain": {"messages": [USER]},
    "no-thinking": {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}},
    "tools-turn1": {"messages": TURN1, "tools": TOOLS, "tool_choice": "auto"},
    "tools-turn2": {"messages": TURN2, "tools": TOOLS, "tool_choice": "auto"},
    "tools-turn3": {"messages": TURN3, "tools": TOOLS, "tool_choice": "auto"},
    "own-logprobs": {"messages": [USER], "logprobs": True, "top_logprobs": 2},
    "own-token-ids": {"messages": [USER], "return_token_ids": True},
    "own-token-ids-and-logprobs": {"messages": [USER], "return_token_ids": True, "logprobs": True},
    "n2": {"messages": [USER], "n": 2, **SEEDED},
    "n2-own-logprobs": {"messages": [USER], "n": 2, "logprobs": True, **SEEDED},
    "forced-tool": {"messages": TURN2, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "read_file"}}},
    "required-tool": {"messages": TURN1, "tools": TOOLS, "tool_choice": "required"},
    "own-prompt-logprobs": {"messages": [USER], "prompt_logprobs": 1},
    "own-tokens-as-ids": {"messages": [USER], "logprobs": True, "return_tokens_as_token_ids": True},
    "continuous-usage": {"messages": [USER], "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "stop": {"messages": [USER], "stop": ["hello"], "max_tokens": 16},
    "no-reasoning-shown": {"messages": [USER], "include_reasoning": False},
}
PROMPT = "The capital of France is"
COMPLETION_CASES = {
    "plain": {"prompt": PROMPT},
    "own-logprobs": {"prompt": PROMPT, "logprobs": 2},
    "own-logprobs-0": {"prompt": PROMPT, "logprobs": 0},
    "own-token-ids": {"prompt": PROMPT, "return_token_ids": True},
    "echo": {"prompt": PROMPT, "echo": True},
    "echo-unicode": {"prompt": "Grüße, 世界 —", "echo": True},
    "echo-own-logprobs": {"prompt": PROMPT, "echo": True, "logprobs": 1},
    "echo-own-token-ids": {"prompt": PROMPT, "echo": True, "return_token_ids": True},
    "echo-own-token-ids-and-logprobs": {"prompt": PROMPT, "echo": True, "return_token_ids": True, "logprobs": 0},
    "two-prompts": {"prompt": [PROMPT, "Hello"]},
    "two-prompts-echo": {"prompt": [PROMPT, "Hello"], "echo": True},
    "token-prompt": {"prompt": [785, 6722, 315, 9625, 374]},
    "n2": {"prompt": PROMPT, "n": 2, **SEEDED},
    "continuous-usage": {"prompt": PROMPT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    "own-prompt-logprobs": {"prompt": PROMPT, "prompt_logprobs": 1},
    "own-tokens-as-ids": {"prompt": PROMPT, "logprobs": 1, "return_tokens_as_token_ids": True},
}
COMPLETION_CASES["echo-token-prompt"] = {"prompt": [785, 6722, 315, 9625, 374], "echo": True}
# Cases the proxy cannot record exactly against vLLM 0.32: the row must say so (error set), and
# the harness still gets the server's answer. (text in the row's error, request keys the truth
# call leaves out: they change what is shown, not what is generated)
CANNOT = {
    # vLLM shows the echoed prompt as text only without return_token_ids (it detokenizes the ids
    # then), so the proxy cannot ask for the ids
    ("completions", "echo-token-prompt"): ("echo with a prompt of token ids", ()),
    # include_reasoning false (with a reasoning parser) hides token_ids and logprobs
    ("chat", "no-reasoning-shown"): ("no completion token ids", ("include_reasoning",)),
}

CASES = [("chat", name, body) for name, body in CHAT_CASES.items()] + \
        [("completions", name, body) for name, body in COMPLETION_CASES.items()]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api,name,case", CASES, ids=[f"{a}-{n}" for a, n, _ in CASES])
def test_capture_matches_real_vllm(stack, api, name, case, stream):  # noqa: F811
    path = CHAT if api == "chat" else COMPLETIONS
    body = {"model": MODEL, "max_tokens": 8, **GREEDY, **case, "stream": stream}
    if stream and name == "plain":
        body["stream_options"] = {"include_usage": True}
    for _ in range(5):  # a new pair while the two streams differ only in where vLLM cut the chunks
        episode = new_episode(f"{api}-{name}")
        st_d, direct = post(stack.vllm + path, body, stream=stream)
        st_p, proxied = post(stack.proxy + path, body, stream=stream, episode=episode)
        if not differs_only_in_chunking(proxied, direct):
            break
    assert st_p == st_d
    if st_d != 200:  # a request vLLM refuses (prompt_logprobs or stream_options with the other stream mode)
        assert proxied == direct and direct.startswith(b'{"error":')
        (row,) = stack.rows(episode)
        assert row["error"].startswith(f"upstream status {st_d}") and row["completion_ids"] is None
        return
    several = stream and (body.get("n", 1) > 1 or isinstance(body["prompt"] if api == "completions" else None, list)
                          and isinstance(body["prompt"][0], str))
    assert_same_answer(proxied, direct, several_choices=several)  # the server's bytes, less only id/created

    rows = stack.rows(episode)
    why, leave_out = CANNOT.get((api, name), (None, ()))
    t = truth(stack, api, {k: v for k, v in body.items() if k not in leave_out})
    assert_no_silent_wrong_row(rows, t)
    assert {r["stream"] for r in rows} == {stream} and {r["status"] for r in rows} == {200}
    assert json.loads(rows[0]["request"]) == body  # the harness's request, not the proxy's
    if not stream:
        assert rows[0]["response"].encode() == proxied  # the answer as the harness got it
    if why is not None:
        assert rows and all(r["error"] and why in r["error"] for r in rows), [r["error"] for r in rows]
        assert all(r["completion_ids"] is None for r in rows)
        return
    if api == "completions" and body.get("echo") and body.get("logprobs") is None:
        # echo: the proxy asks for no logprobs (vLLM would compute the prompt's too), so the row
        # cannot train: it says so (an error naming the fix), never a success without logprobs
        assert all(r["error"] and r["error"].startswith("no logprobs: completions with echo") for r in rows)
        assert all(r["completion_ids"] is None for r in rows)
        return
    # (echo with the harness's own logprobs: vLLM's cover the prompt too, the row keeps the completion's)
    assert_rows_match(rows, t)



FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness-requests"


@pytest.mark.parametrize("harness", ["qwen-code", "pi"])
def test_recorded_harness_requests(stack, harness):  # noqa: F811
    """The requests Qwen Code and Pi really sent (up to 80 KB, ~17k-token prompts, 15 tools,
    streamed with include_usage), in one episode as the harness sent them: greedy and cut to
    8 tokens, otherwise as recorded."""
    episode = new_episode(f"replay-{harness}")
    sent = 0
    kept = []  # (body, the row index of its call)
    for line in (FIXTURES / f"{harness}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        limit = "max_completion_tokens" if "max_completion_tokens" in rec["body"] else "max_tokens"
        body = {**rec["body"], "model": MODEL, limit: 8, "temperature": 0}
        for _ in range(5):  # (see test_capture_matches_real_vllm)
            _, direct = post(stack.vllm + rec["path"], body, stream=True)
            _, proxied = post(stack.proxy + rec["path"], body, stream=True, episode=episode)
            sent += 1
            if not differs_only_in_chunking(proxied, direct):
                break
        assert_same_answer(proxied, direct)
        kept.append((body, sent - 1))
    rows = stack.rows(episode)
    assert len(rows) == sent
    for body, i in kept:
        assert json.loads(rows[i]["request"]) == body
        assert_rows_match([rows[i]], truth(stack, "chat", body))
        assert len(rows[i]["prompt_ids"]) > 1000
