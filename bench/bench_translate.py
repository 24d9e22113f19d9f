"""Translation overhead per call of the Responses (Codex) and Messages (Claude Code) translators.

For each recorded real request (tests/fixtures/harness-requests, 40-80 KB bodies) one call is:
request_to_chat on the parsed body + serializing the chat body + translating a typical streamed
answer (vLLM-shaped chunks with token ids: ~150 reasoning deltas, ~30 text deltas, a tool call
with ~25 argument deltas, finish and usage chunks) + finish(). This is the work the chat path
does not do; the bodies are parsed once outside the timer because the chat path parses too.

    .venv/bin/python bench/bench_translate.py [--iters 300]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import orjson

from polar_contracts.translate import translator_for


def typical_answer(tool_name: str) -> list[dict]:
    def chunk(delta, finish=None, first=False):
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                  "stop_reason": None}
        c = {"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1,
             "model": "qwen3", "choices": [choice]}
        if first:
            c["prompt_token_ids"] = list(range(12000))
        else:
            choice["token_ids"] = [1234]
        return c
    out = [chunk({"role": "assistant", "content": ""}, first=True)]
    out += [chunk({"reasoning": f" word{i}"}) for i in range(150)]
    out += [chunk({"content": f" text{i}"}) for i in range(30)]
    out.append(chunk({"content": None, "tool_calls": [{"index": 0, "id": "chatcmpl-tool-1",
                      "type": "function", "function": {"name": tool_name, "arguments": ""}}]}))
    args = json.dumps({"command": "echo hi > hello.txt && cat hello.txt " * 3})
    step = max(1, len(args) // 25)
    out += [chunk({"content": None, "tool_calls": [{"index": 0, "function": {
        "arguments": args[i:i + step]}}]}) for i in range(0, len(args), step)]
    out.append(chunk({}, finish="tool_calls"))
    out.append({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1,
                "model": "qwen3", "choices": [],
                "usage": {"prompt_tokens": 12000, "completion_tokens": 210,
                          "total_tokens": 12210}})
    return out


def one_call(call: dict, chunks: list[dict]) -> tuple[float, float]:
    """(ms for request translation + body serialization, ms for the whole call)."""
    t0 = time.perf_counter_ns()
    t = translator_for(call["method"], call["path"])
    chat = t.request_to_chat(call["body"], call["headers"])
    orjson.dumps(chat)
    t1 = time.perf_counter_ns()
    for c in chunks:
        t.feed_chunk(c)
    t.finish()
    t2 = time.perf_counter_ns()
    return (t1 - t0) / 1e6, (t2 - t0) / 1e6


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    fixtures = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "harness-requests"
    for name, tool in (("codex", "exec_command"), ("claude-code", "Bash")):
        lines = (fixtures / f"{name}.jsonl").read_text().splitlines()
        calls = [json.loads(x) for x in lines if x.strip()]
        sizes = [len(orjson.dumps(c["body"])) // 1024 for c in calls]
        chunks = typical_answer(tool)
        for c in calls:  # warm up
            one_call(c, chunks)
        req, total = [], []
        for _ in range(args.iters):
            for c in calls:
                a, b = one_call(c, chunks)
                req.append(a)
                total.append(b)
        print(f"{name:12s} bodies {sizes} KB, {len(chunks)} chunks/answer, {len(total)} calls: "
              f"request p50 {statistics.median(req):.3f} ms p99 {pct(req, 0.99):.3f} ms | "
              f"request+stream p50 {statistics.median(total):.3f} ms p99 {pct(total, 0.99):.3f} ms")


if __name__ == "__main__":
    main()
