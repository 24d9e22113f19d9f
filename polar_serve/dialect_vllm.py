"""vLLM 0.33 wire format: JSON layouts of chat / completions answers, stream chunks and errors.

Followed: `entrypoints/openai/chat_completion/protocol.py` (ChatMessage, ChatCompletionResponse[Choice],
ChatCompletionStreamResponse, ChatCompletionLogProbsContent), `completion/protocol.py`,
`chat_completion/serving.py` (chunk construction) and wire-formats.md (byte-exact findings).
- Non-streaming answers are full `model_dump()`s: every declared field present, nulls included;
  `message.tool_calls` is dropped when empty (ChatMessage's serializer).
- Stream chunks are `model_dump_json(exclude_unset=True)`: only fields the server sets appear.
  First chunk per choice: `delta {role, content: ""}`, `logprobs: null`, `finish_reason: null`,
  and top-level `prompt_token_ids` (ids or null) and `prompt_text: null`. Later chunks set
  `logprobs`, `finish_reason`, `token_ids` (null unless `return_token_ids`) and carry top-level
  `kv_transfer_params: null`; the finishing chunk adds `stop_reason`. A tool-call delta carries
  `content: null`; its first item is `{id, type, index, function: {name}}` (no arguments), later
  ones `{index, function: {arguments: fragment}}` (parsers.StreamParser). With
  `stream_options.include_usage` a last chunk has `choices: []` and `usage`.
- n > 1 streams: n first chunks (index 0..n-1), then each chunk carries one choice by index.
- Errors: `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import json

from polar_recon.chat_render import VLLM_RENDER

from . import parsers
from .dialect import Dialect, hex_id
from .generation import (
    GenerationRequest,
    GenerationResult,
    chat_logprob_entries,
    legacy_logprobs,
    new_stream_parser,
    parse_result,
)


def error_body(message: str, err_type: str = "BadRequestError", status: int = 400) -> dict:
    return {"error": {"message": message, "type": err_type, "param": None, "code": status}}


def _usage(p: int, c: int) -> dict:
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": None}


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _logprob_entry(token: str, logprob: float, utf8: list[int]) -> dict:
    return {"token": token, "logprob": logprob, "bytes": utf8}  # ChatCompletionLogProb's field order


def _tool_call(tc) -> dict:
    return {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}


def chat_full(req: GenerationRequest, res: GenerationResult, tokenizer) -> dict:
    b = req.body
    p = parse_result(req, res)
    for tc in p.tool_calls:
        tc.id = req.dialect.tool_call_id()
    msg = {"role": "assistant", "content": p.content, "refusal": None, "annotations": None, "audio": None,
           "function_call": None}
    if p.tool_calls:
        msg["tool_calls"] = [_tool_call(tc) for tc in p.tool_calls]
    # include_reasoning=false hides the reasoning AND the per-token metadata (wire-formats.md caveat).
    hide = b.get("include_reasoning", True) is False
    msg["reasoning"] = None if hide else p.reasoning
    finish = "tool_calls" if p.tool_calls else res.finish_reason
    lp = None
    if b.get("logprobs") and not hide:
        lp = {"content": chat_logprob_entries(tokenizer, res.steps, bool(b.get("return_tokens_as_token_ids")),
                                                 _logprob_entry)}
    want_ids = bool(b.get("return_token_ids")) and not hide
    choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish, "stop_reason": res.stop_reason,
              "token_ids": res.ids if want_ids else None}
    return {"id": req.request_id, "object": "chat.completion", "created": req.created, "model": req.model_name,
            "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": _usage(len(req.prompt_ids), len(res.steps)), "prompt_logprobs": None,
            "prompt_token_ids": req.prompt_ids if want_ids else None,
            "prompt_text": req.prompt_text if b.get("return_prompt_text") else None,
            "kv_transfer_params": None}


def _delta(d: dict) -> dict:
    if "reasoning" in d:
        return {"reasoning": d["reasoning"]}
    if "content" in d:
        return {"content": d["content"]}
    tc = d["tool_call"]
    if "name" in tc:
        item = {"id": tc["id"], "type": "function", "index": tc["index"], "function": {"name": tc["name"]}}
    else:
        item = {"index": tc["index"], "function": {"arguments": tc["arguments"]}}
    return {"content": None, "tool_calls": [item]}


def _merge(deltas: list[dict]) -> dict:
    """Several parser deltas produced by one token (rare) folded into one DeltaMessage."""
    out: dict = {}
    for d in (_delta(x) for x in deltas):
        for k, v in d.items():
            if k in ("content", "reasoning") and isinstance(v, str) and isinstance(out.get(k), str):
                out[k] += v
            elif k == "tool_calls":
                out.setdefault("tool_calls", []).extend(v)
            elif k not in out or out[k] is None:
                out[k] = v
    return out


async def chat_stream(reqs: list[GenerationRequest], queues: list, tokenizer):
    """One stream for n choices (n = len(reqs), one generation each). Like vLLM: the first chunk of
    every choice (role, prompt ids) goes out before any token; then each chunk carries one choice
    by its index. Our engine generates the choices one after the other, so their chunks come in
    index order rather than token-interleaved (both are valid vLLM streams: clients key on index)."""
    req = reqs[0]
    b = req.body
    head = {"id": req.request_id, "object": "chat.completion.chunk", "created": req.created, "model": req.model_name}
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    for i in range(len(reqs)):
        first = dict(head, choices=[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}],
                     prompt_token_ids=req.prompt_ids if b.get("return_token_ids") else None, prompt_text=None)
        if b.get("return_prompt_text"):
            first["prompt_text"] = req.prompt_text
        yield _sse(first)
    counts = [0] * len(reqs)
    for i, (c, q) in enumerate(zip(reqs, queues, strict=True)):
        failed = False
        async for chunk in _choice_chunks(c, q, tokenizer, i, head, counts):
            failed = failed or "error" in chunk
            yield _sse(chunk)
        if failed:
            break
    if usage_on:
        u = _usage(len(req.prompt_ids), sum(counts))
        u.pop("prompt_tokens_details")
        yield _sse(dict(head, choices=[], usage=u))
    yield b"data: [DONE]\n\n"


async def _choice_chunks(req: GenerationRequest, queue, tokenizer, index: int, head: dict, counts: list[int]):
    """The content chunks of choice `index` (dicts), ending with its finish chunk or an error body."""
    b = req.body
    hide = b.get("include_reasoning", True) is False  # vLLM's hide_stream_metadata
    want_ids = bool(b.get("return_token_ids")) and not hide
    want_lp = bool(b.get("logprobs")) and not hide
    as_ids = bool(b.get("return_tokens_as_token_ids"))
    parser = new_stream_parser(req)
    text, pending = "", []
    saw_tool = False
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield error_body(f"generation failed: {ev.error}", "InternalServerError", 500)
            return
        final = ev.kind == "done"
        if ev.step is not None:
            counts[index] += 1
            text += ev.text
            pending.append(ev.step)
        deltas = parser.feed(text, final=final)
        saw_tool = saw_tool or any("tool_call" in d for d in deltas)
        if hide:
            deltas = [d for d in deltas if "reasoning" not in d]
        if not deltas and not final and not want_ids and not want_lp:
            continue  # vLLM skips a token without a delta unless ids or logprobs were asked for
        lp = {"content": chat_logprob_entries(tokenizer, pending, as_ids, _logprob_entry)} if want_lp else None
        choice = {"index": index, "delta": _merge(deltas) if deltas else {}, "logprobs": lp, "finish_reason": None}
        if final:
            choice["finish_reason"] = "tool_calls" if saw_tool and ev.finish_reason == "stop" else ev.finish_reason
            choice["stop_reason"] = ev.stop_reason
        choice["token_ids"] = [s.token_id for s in pending] if want_ids else None
        pending = []
        yield dict(head, choices=[choice], kv_transfer_params=None)
        if final:
            return


# -- /v1/completions ------------------------------------------------------------------------------
def completion_full(req: GenerationRequest, res: GenerationResult, tokenizer) -> dict:
    b = req.body
    want_ids = bool(b.get("return_token_ids"))
    echo = bool(b.get("echo"))
    lp = None
    if b.get("logprobs") is not None and b.get("logprobs") is not False:
        lp = legacy_logprobs(tokenizer, res.steps, bool(b.get("return_tokens_as_token_ids")))
    text = (req.prompt_text + res.text) if echo else res.text
    ids = (req.prompt_ids + res.ids) if echo else res.ids
    choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": res.finish_reason,
              "stop_reason": res.stop_reason, "token_ids": ids if want_ids else None, "prompt_logprobs": None,
              "prompt_token_ids": req.prompt_ids if want_ids else None}
    return {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model_name,
            "choices": [choice], "service_tier": None, "system_fingerprint": None,
            "usage": _usage(len(req.prompt_ids), len(res.steps)), "kv_transfer_params": None}


async def completion_stream(req: GenerationRequest, queue, tokenizer):
    b = req.body
    head = {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model_name}
    want_ids = bool(b.get("return_token_ids"))
    want_lp = b.get("logprobs") is not None and b.get("logprobs") is not False
    as_ids = bool(b.get("return_tokens_as_token_ids"))
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    first = True
    n = 0
    offset = 0
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield _sse(error_body(f"generation failed: {ev.error}", "InternalServerError", 500))
            break
        final = ev.kind == "done"
        steps = [ev.step] if ev.step is not None else []
        n += len(steps)
        choice = {"index": 0, "text": ev.text,
                  "logprobs": legacy_logprobs(tokenizer, steps, as_ids, offset) if want_lp and steps else None,
                  "finish_reason": ev.finish_reason if final else None,
                  "stop_reason": ev.stop_reason if final else None}
        offset += len(ev.text)
        if want_ids:
            choice["token_ids"] = [s.token_id for s in steps]
            if first:
                choice["prompt_token_ids"] = req.prompt_ids
        first = False
        yield _sse(dict(head, choices=[choice]))
        if final:
            break
    if usage_on:
        yield _sse(dict(head, choices=[], usage={"prompt_tokens": len(req.prompt_ids),
                                                 "total_tokens": len(req.prompt_ids) + n, "completion_tokens": n}))
    yield b"data: [DONE]\n\n"


class VLLM(Dialect):
    name = "vllm"
    render = VLLM_RENDER
    tool_start = parsers.TOOL_START
    tool_end = parsers.TOOL_END
    checks_model_name = True

    def split_reasoning(self, text, thinking):
        return parsers.split_reasoning_vllm(text, thinking)

    def split_tools(self, rest, tool_names, partial):
        return parsers.split_tools_vllm(rest, partial)

    def tool_call_id(self) -> str:
        return f"chatcmpl-tool-{hex_id()}"

    def chat_id(self) -> str:
        return f"chatcmpl-{hex_id()}"

    def completion_id(self) -> str:
        return f"cmpl-{hex_id()}"

    def model_name(self, body: dict, served_name: str) -> str:
        return served_name

    def error_body(self, message: str, status: int, err_type: str | None) -> dict:
        t = err_type or {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
        return error_body(message, t, status)

    def chat_full(self, server, req, res, started):
        return chat_full(req, res, server.model.tokenizer)

    def chat_stream(self, server, reqs, queues, headers):
        return chat_stream(reqs, queues, server.model.tokenizer)

    def completion_full(self, server, req, res):
        return completion_full(req, res, server.model.tokenizer)

    def completion_stream(self, server, req, queue):
        return completion_stream(req, queue, server.model.tokenizer)

    def model_card(self, server, name, created):
        return {"id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": str(server.model.model_dir), "parent": None, "max_model_len": server.model.max_len,
                "permission": []}

    def tokenize_extra(self, out, body, tokenizer):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(out["tokens"]) if body.get("return_token_strs") else None
