"""Responses (`/v1/responses`) and Messages (`/v1/messages`) through the capture proxy in front of the
REAL vLLM 0.32: the proxy translates each request to chat completions upstream (vLLM returns no ids
on those endpoints) and the answer back.

For every case: the harness gets a well-formed answer in its own API, equal to what the translator
makes of vLLM's direct answer to the translated chat request (sent as the proxy sends it, with the
id flags), less only the per-call values (TRANSLATED_VOLATILE); the row holds the server's own ids
and logprobs for that chat request.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from addon.json_style import dumps_like_python
from addon.server_dialects import plan_request
from addon.sse import SSEParser
from polar_contracts.translate import translator_for

from .capture_support import (
    CHAT,
    MODEL,
    assert_rows_match,
    coalesced,
    new_episode,
    post,
    stack,  # noqa: F401 - the module's fixture
    truth,
)

# Per-call values in the translated answers: the ids the translator mints (`resp_…`, `msg_…`, `fc_…`,
# `rs_…`; `id`, `item_id`) and vLLM's tool-call ids they carry (`call_id`), the Responses
# `created_at` time, and the reasoning `signature` Messages derives from the call.
TRANSLATED_VOLATILE = re.compile(rb'"(id|item_id|call_id|created_at|signature)":("[^"]*"|\d+(\.\d+)?)')


def tnorm(raw: bytes) -> bytes:
    return TRANSLATED_VOLATILE.sub(rb'"\1":"X"', raw)


TOOL_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
RESPONSES_CASES = {
    "plain": {"instructions": "You are a coding agent.",
              "input": [{"role": "user", "content": [{"type": "input_text", "text": "Create hello.txt — ünï?"}]}]},
    "tools-history": {
        "instructions": "You are a coding agent.",
        "tools": [{"type": "function", "name": "read_file", "description": "Read a file.", "parameters": TOOL_SCHEMA}],
        "tool_choice": "auto",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Read hello.txt"}]},
            {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path":"hello.txt"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "hi ✓"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "It says hi."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Thanks. And hello2.txt?"}]},
        ]},
}
MESSAGES_CASES = {
    "plain": {"system": "You are a coding agent.", "messages": [{"role": "user", "content": "Create hello.txt — ünï?"}]},
    "tools-history": {
        "system": [{"type": "text", "text": "You are a coding agent."}],
        "tools": [{"name": "read_file", "description": "Read a file.", "input_schema": TOOL_SCHEMA}],
        "tool_choice": {"type": "auto"},
        "messages": [
            {"role": "user", "content": "Read hello.txt"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Reading it."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "hello.txt"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "hi ✓"}]},
        ]},
}
CASES = [("/v1/responses", n, {"max_output_tokens": 8, **b}) for n, b in RESPONSES_CASES.items()] + \
        [("/v1/messages", n, {"max_tokens": 8, **b}) for n, b in MESSAGES_CASES.items()]


def translated_direct(stk, path: str, body: dict, stream: bool) -> tuple[dict, bytes, bytes]:
    """The translated chat request, what the translator makes of vLLM's direct answer to it, and
    that answer. Asked with the proxy's id flags, as the proxy asks: the translator uses the prompt
    ids (Messages' message_start counts its input_tokens from them, before any usage arrives)."""
    t = translator_for("POST", path)
    chat_body = t.request_to_chat(json.loads(json.dumps(body)), {})
    flags = plan_request("chat", "vllm", chat_body).added
    st, raw = post(stk.vllm + CHAT, {**chat_body, **flags}, stream=stream)
    assert st == 200, raw[:500]
    if not stream:
        return chat_body, dumps_like_python(t.response_from_chat(json.loads(raw))), raw
    parser, out = SSEParser(), []
    for ev in [*parser.feed(raw), *parser.close()]:
        if ev.data_bytes == b"[DONE]":
            out.append(t.finish())
        elif ev.data_bytes is not None:
            out.append(t.feed_chunk(json.loads(ev.data_bytes)))
    return chat_body, b"".join(out), raw


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().split("\n\n"):
        name = data = None
        for line in block.splitlines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
        if data is not None:
            assert data.get("type") == name, block  # both APIs repeat the event name as data.type
            out.append((name, data))
    return out


def assert_well_formed(path: str, raw: bytes, stream: bool) -> None:
    if path == "/v1/messages":
        if not stream:
            msg = json.loads(raw)
            assert msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == MODEL
            assert msg["stop_reason"] in ("end_turn", "max_tokens", "tool_use") and msg["usage"]["output_tokens"] == 8
            return
        names = [n for n, _ in events(raw)]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        assert names.count("content_block_start") == names.count("content_block_stop")
        return
    if not stream:
        resp = json.loads(raw)
        assert resp["object"] == "response" and resp["status"] in ("completed", "incomplete") and resp["output"]
        return
    evs = events(raw)
    names = [n for n, _ in evs]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] in ("response.completed", "response.incomplete")
    assert names.count("response.output_item.added") == names.count("response.output_item.done")
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path,name,case", CASES, ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, n, _ in CASES])
def test_translated_call_matches_real_vllm(stack, path, name, case, stream):  # noqa: F811
    body = {"model": MODEL, "temperature": 0, **case, "stream": stream}
    # vLLM cuts a stream into chunks per call (capture_support.differs_only_in_chunking) and each
    # chat chunk becomes its own delta event: a new pair while the upstream streams differ only there
    for _ in range(3):
        chat_body, expected, chat_raw = translated_direct(stack, path, body, stream)
        episode = new_episode(path.rsplit("/", 1)[1])
        st, got = post(stack.proxy + path, body, stream=stream, episode=episode)
        assert st == 200, got[:500]
        (row,) = stack.rows(episode)
        if not stream or tnorm(got) == tnorm(expected) or not _same_chat_content(chat_raw, row):
            break
    assert_well_formed(path, got, stream)
    assert tnorm(got).split(b"\n") == tnorm(expected).split(b"\n")
    assert row["api"] == path.rsplit("/", 1)[1] and row["stream"] is stream and row["status"] == 200
    assert json.loads(row["request"]) == body
    assert_rows_match([row], truth(stack, "chat", chat_body))


def _same_chat_content(chat_raw: bytes, row: dict) -> bool:
    """The direct chat stream and the one the proxy got (the row's reassembled upstream answer)
    carry the same text and tool calls."""
    direct = coalesced(chat_raw)["choices"][0].get("delta") or {}
    direct = {k: v for k, v in direct.items() if v not in (None, "") and k != "role"}
    got = json.loads(row["response"])["choices"][0]["message"]
    got = {k: v for k, v in got.items() if v not in (None, "") and k != "role"}
    return direct == got


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harness-requests"


@pytest.mark.parametrize("harness", ["codex", "claude-code"])
def test_recorded_harness_requests(stack, harness):  # noqa: F811
    """The requests Codex (Responses) and Claude Code (Messages) really sent (40-80 KB, streamed,
    reasoning / thinking on), in one episode: greedy and cut to 8 tokens, otherwise as recorded."""
    episode = new_episode(f"replay-{harness}")
    sent = 0
    kept = []  # (chat body, the row index of its call)
    for line in (FIXTURES / f"{harness}.jsonl").read_text().splitlines():
        rec = json.loads(line)
        path = rec["path"]
        limit = "max_output_tokens" if path.startswith("/v1/responses") else "max_tokens"
        body = {**rec["body"], "model": MODEL, limit: 8, "temperature": 0}
        for _ in range(3):  # (see test_translated_call_matches_real_vllm)
            chat_body, expected, chat_raw = translated_direct(stack, path.split("?")[0], body, True)
            st, got = post(stack.proxy + path, body, stream=True, episode=episode)
            sent += 1
            assert st == 200, got[:500]
            if tnorm(got) == tnorm(expected) or not _same_chat_content(chat_raw, stack.rows(episode)[-1]):
                break
        assert_well_formed(path.split("?")[0], got, True)
        assert tnorm(got).split(b"\n") == tnorm(expected).split(b"\n")
        kept.append((chat_body, sent - 1))
    rows = stack.rows(episode)
    assert len(rows) == sent
    for chat_body, i in kept:
        assert_rows_match([rows[i]], truth(stack, "chat", chat_body))
        assert len(rows[i]["prompt_ids"]) > 1000
