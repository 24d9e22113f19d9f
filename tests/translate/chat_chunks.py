"""Realistic upstream chat-completions streams, shaped as vLLM 0.32 and SGLang 0.5.23 send them
(docs/reference.md, "Wire formats"): vLLM names the reasoning delta `reasoning`, puts `prompt_token_ids` on the
first chunk and `token_ids` on every later one, and says `stop_reason`; SGLang names it
`reasoning_content`, keeps `matched_stop`, and sends an `sglext` chunk before the usage chunk.
"""
from __future__ import annotations

import json

PROMPT_IDS = list(range(100, 1100))  # 1000 prompt tokens


def _chunk(dialect: str, delta: dict | None = None, finish=None, stop=None, n_ids=1, first=False):
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    chunk = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1,
             "model": "qwen3", "choices": [choice]}
    if dialect == "vllm":
        choice["stop_reason"] = stop
        if first:
            chunk["prompt_token_ids"] = PROMPT_IDS
        else:
            choice["token_ids"] = list(range(n_ids))
    else:
        choice["matched_stop"] = stop
    return chunk


def pieces(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def stream(parts: list[tuple], dialect: str = "vllm", finish: str = "stop", stop=None,
           completion_tokens: int = 42, reasoning_tokens: int | None = None) -> list[dict]:
    """parts: ("reasoning", text) | ("text", text) | ("tool", name, arguments_dict) in order."""
    rkey = "reasoning" if dialect == "vllm" else "reasoning_content"
    out = [_chunk(dialect, {"role": "assistant", "content": ""}, first=True)]
    tool_index = 0
    for part in parts:
        if part[0] in ("reasoning", "text"):
            key = rkey if part[0] == "reasoning" else "content"
            for p in pieces(part[1]):
                out.append(_chunk(dialect, {key: p}))
        elif part[0] == "tool":
            args = json.dumps(part[2])
            call_id = f"chatcmpl-tool-{tool_index}" if dialect == "vllm" else f"call_{tool_index}"
            out.append(_chunk(dialect, {"content": None, "tool_calls": [{
                "index": tool_index, "id": call_id, "type": "function",
                "function": {"name": part[1], "arguments": ""}}]}))
            for p in pieces(args, 7):
                out.append(_chunk(dialect, {"content": None, "tool_calls": [{
                    "index": tool_index, "function": {"arguments": p}}]}))
            tool_index += 1
    if dialect == "sglang" and finish == "tool_calls":
        stop = 151645  # SGLang keeps the eos id as matched_stop on a tool-call finish
    out.append(_chunk(dialect, {}, finish=finish, stop=stop))
    if dialect == "sglang":
        out.append({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1,
                    "model": "qwen3", "choices": [],
                    "sglext": {"input_ids": PROMPT_IDS, "output_ids": [[1] * completion_tokens]}})
    usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": completion_tokens,
             "total_tokens": len(PROMPT_IDS) + completion_tokens}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    out.append({"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1,
                "model": "qwen3", "choices": [], "usage": usage})
    return out


def full_response(parts: list[tuple], dialect: str = "vllm", finish: str = "stop",
                  stop=None) -> dict:
    """The non-streaming answer for the same parts (with the id fields each server adds)."""
    msg: dict = {"role": "assistant", "content": None}
    texts = [p[1] for p in parts if p[0] == "text"]
    reasoning = "".join(p[1] for p in parts if p[0] == "reasoning")
    if texts:
        msg["content"] = "".join(texts)
    if reasoning:
        msg["reasoning" if dialect == "vllm" else "reasoning_content"] = reasoning
    calls = [{"id": f"call_{i}", "type": "function",
              "function": {"name": p[1], "arguments": json.dumps(p[2])}}
             for i, p in enumerate(q for q in parts if q[0] == "tool")]
    if calls:
        msg["tool_calls"] = calls
    choice = {"index": 0, "message": msg, "finish_reason": finish, "logprobs": {"content": []}}
    resp = {"id": "chatcmpl-test", "object": "chat.completion", "created": 1, "model": "qwen3",
            "choices": [choice],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 42, "total_tokens": 1042}}
    if dialect == "vllm":
        choice["stop_reason"] = stop
        choice["token_ids"] = [1, 2, 3]
        resp["prompt_token_ids"] = PROMPT_IDS
    else:
        choice["matched_stop"] = stop
        choice["prompt_token_ids"] = PROMPT_IDS
        choice["response_token_ids"] = [1, 2, 3]
        choice["meta_info"] = {"id": "x"}
    return resp


def parse_sse(data: bytes) -> list[tuple[str, dict]]:
    """(event name, data object) for each SSE event; fails on anything malformed."""
    events = []
    text = data.decode()
    assert text.endswith("\n\n") or not text, "SSE stream must end with a blank line"
    for block in text.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: "), block[:200]
        assert len(lines) == 2, block[:200]
        events.append((lines[0][7:], json.loads(lines[1][6:])))
    return events
