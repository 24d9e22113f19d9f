"""SGLang 0.5.23 wire format: chat / completions / native /generate layouts, sglext, errors.

Followed: `srt/entrypoints/openai/protocol.py` (ChatMessage, ChatCompletionResponseChoice with its
serializer dropping unset id fields, DeltaMessage, ChatCompletionStreamResponse with `sglext`,
ToolCall {id, index, type, function}, UsageInfo), `serving_chat.py` (first chunk `{role, content: ""}`,
separate finish chunk with an empty delta and `matched_stop`, usage chunk after it),
`srt/managers/io_struct.py` (GenerateReqInput) and wire-formats.md:
- ids on the choice: `prompt_token_ids` / `response_token_ids` (non-streaming only; the flags are
  rejected with `stream: true`), `meta_info` with `return_meta_info`. Later SGLang sources (and its
  own tests) name the output field `token_ids` and let `return_token_ids` imply
  `prompt_token_ids`: `polar-serve --sglang-token-ids-field token_ids` serves that layout;
- streaming ids through sglext: request fields `return_input_ids_in_sglext` /
  `return_output_ids_in_sglext` or headers `x-sglext-return-input-ids` / `-output-ids`; a chunk with
  `choices: []` and `sglext: {input_ids, output_ids: [[...]]}` comes before the usage chunk
  (`x-sglext-ids-framed: 1` sends it as SSE event `sglext_ids`);
- tool calls stream as `{id, index, type, function: {name, arguments: ""}}` then
  `{id: null, index, type, function: {name: null, arguments: fragment}}` (parsers.StreamParser);
- n > 1 streams: each chunk carries one choice by index; finish chunks for all choices follow
  all output; sglext `output_ids` has one list per choice; usage counts the prompt once;
- chunks and answers are full dumps (nulls included); errors are
  `{"object": "error", "message", "type", "param", "code"}`.
"""
from __future__ import annotations

import json
import time

from polar_recon.chat_render import SGLANG_RENDER, RequestError

from . import parsers
from .chat import Call, Result, chat_logprob_entries, new_stream_parser, parse_result, reasoning_token_count
from .dialect import Dialect, hex_id
from .dialect_vllm import legacy_logprobs

STREAM_REJECTED = ("return_prompt_token_ids", "return_token_ids", "return_meta_info")


def error_body(message: str, err_type: str = "BadRequest", status: int = 400) -> dict:
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


# The messages serving_chat.py raises (as ValueError -> 400 BadRequest) for these flags with stream.
_REJECT_MESSAGES = {
    "return_prompt_token_ids": "return_prompt_token_ids is not supported with streaming. "
                               "Please set stream=false when using return_prompt_token_ids=true.",
    "return_token_ids": "return_token_ids is not supported with streaming on /v1/chat/completions. "
                        "Please set stream=false when using return_token_ids=true.",
    "return_meta_info": "return_meta_info is not supported with streaming. "
                        "Please set stream=false when using return_meta_info=true.",
}


def check_chat(body: dict) -> None:
    if body.get("stream"):
        for f in STREAM_REJECTED:
            if body.get(f):
                raise RequestError(_REJECT_MESSAGES[f])


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _matched(res: Result, eos_ids) -> int | str | None:
    if res.finish_reason != "stop":
        return None
    if res.stop_reason is not None:
        return res.stop_reason
    return res.steps[-1].token_id if res.steps else None


def _usage(call: Call, ids: list[int], tokenizer) -> dict:
    p, c = len(call.prompt_ids), len(ids)
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": None,
            "reasoning_tokens": reasoning_token_count(ids, tokenizer, True) if call.thinking else 0}


def meta_info(call: Call, res: Result, weight_version: str, eos_ids, started: float) -> dict:
    fr = {"type": res.finish_reason}
    m = _matched(res, eos_ids)
    if res.finish_reason == "length":
        fr["length"] = len(res.steps)
    elif m is not None:
        fr["matched"] = m
    return {"id": call.request_id, "finish_reason": fr, "prompt_tokens": len(call.prompt_ids),
            "weight_version": weight_version, "completion_tokens": len(res.steps), "cached_tokens": 0,
            "e2e_latency": round(time.time() - started, 6)}


def chat_full(call: Call, res: Result, tokenizer, weight_version: str, eos_ids, started: float,
              ids_field: str = "response_token_ids") -> dict:
    b = call.body
    p = parse_result(call, res)
    tcs = None
    if p.tool_calls:
        tcs = [{"id": call.dialect.tool_call_id(), "index": i, "type": "function",
                "function": {"name": tc.name, "arguments": tc.arguments}} for i, tc in enumerate(p.tool_calls)]
    finish = "tool_calls" if tcs and res.finish_reason == "stop" else res.finish_reason
    msg = {"role": "assistant", "content": p.content, "reasoning_content": p.reasoning, "tool_calls": tcs}
    lp = None
    if b.get("logprobs"):
        lp = {"content": chat_logprob_entries(tokenizer, res.steps, bool(b.get("return_tokens_as_token_ids")), True)}
    choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish,
              "matched_stop": _matched(res, eos_ids)}
    if ids_field == "token_ids":
        # Later SGLang sources: return_token_ids gives `token_ids` and implies prompt_token_ids.
        if b.get("return_prompt_token_ids") or b.get("return_token_ids"):
            choice["prompt_token_ids"] = call.prompt_ids
        if b.get("return_token_ids"):
            choice["token_ids"] = res.ids
    else:
        if b.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = call.prompt_ids
        if b.get("return_token_ids"):
            choice["response_token_ids"] = res.ids
    if b.get("return_meta_info"):
        choice["meta_info"] = meta_info(call, res, weight_version, eos_ids, started)
    return {"id": call.request_id, "object": "chat.completion", "created": call.created, "model": call.model_name,
            "choices": [choice], "usage": _usage(call, res.ids, tokenizer), "metadata": None}


def _flag(body: dict, headers, field: str, header: str) -> bool:
    return bool(body.get(field)) or headers.get(header, "").strip().lower() in ("1", "true", "yes")


def _empty_delta() -> dict:
    return {"role": None, "content": None, "reasoning_content": None, "tool_calls": None}


def _delta(d: dict) -> dict:
    out = _empty_delta()
    if "reasoning" in d:
        out["reasoning_content"] = d["reasoning"]
    elif "content" in d:
        out["content"] = d["content"]
    else:
        tc = d["tool_call"]
        named = "name" in tc
        out["tool_calls"] = [{"id": tc.get("id") if named else None, "index": tc["index"], "type": "function",
                              "function": {"name": tc.get("name") if named else None,
                                           "arguments": "" if named else tc["arguments"]}}]
    return out


async def chat_stream(calls: list[Call], queues: list, tokenizer, headers, eos_ids):
    """One stream for n choices (n = len(calls)). Like serving_chat.py: a choice's first chunk
    (role) when its output starts, its deltas (one chunk each), then, after all output, one finish
    chunk per choice, the sglext chunk (output_ids per choice) and the usage chunk. Our engine
    generates the choices one after the other, so their chunks come in index order."""
    call = calls[0]
    b = call.body
    head = {"id": call.request_id, "object": "chat.completion.chunk", "created": call.created, "model": call.model_name}
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    in_ids = _flag(b, headers, "return_input_ids_in_sglext", "x-sglext-return-input-ids")
    out_ids = _flag(b, headers, "return_output_ids_in_sglext", "x-sglext-return-output-ids")
    framed = headers.get("x-sglext-ids-framed", "").strip().lower() in ("1", "true", "yes")

    def chunk(choices, usage=None, **extra):
        return dict(head, choices=choices, usage=usage, **extra)

    results, finishes = [], []
    for i, (c, q) in enumerate(zip(calls, queues)):
        yield _sse(chunk([{"index": i, "delta": dict(_empty_delta(), role="assistant", content=""), "logprobs": None,
                           "finish_reason": None, "matched_stop": None}]))
        res, tail = Result(), {}
        async for choice in _choice_deltas(c, q, tokenizer, i, res, tail):
            if "error" in choice:
                yield _sse(error_body(choice["error"], "InternalServerError", 500))
                return
            yield _sse(chunk([choice]))
        results.append(res)
        finishes.append(tail)
    for i, (res, tail) in enumerate(zip(results, finishes)):
        finish = "tool_calls" if tail["saw_tool"] and res.finish_reason == "stop" else res.finish_reason
        yield _sse(chunk([{"index": i, "delta": _empty_delta(), "logprobs": tail["logprobs"], "finish_reason": finish,
                           "matched_stop": _matched(res, eos_ids)}]))
    if in_ids or out_ids:
        ext = {}
        if in_ids:
            ext["input_ids"] = call.prompt_ids
        if out_ids:
            ext["output_ids"] = [r.ids for r in results]
        body = chunk([], sglext=ext)
        if framed:
            yield b"event: sglext_ids\n" + _sse(body)
        else:
            yield _sse(body)
    if usage_on:
        u = _usage(call, results[0].ids, tokenizer)
        for r in results[1:]:  # the prompt counts once; completions and reasoning add up
            more = _usage(call, r.ids, tokenizer)
            u["completion_tokens"] += more["completion_tokens"]
            u["reasoning_tokens"] += more["reasoning_tokens"]
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
        yield _sse(chunk([], usage=u))
    yield b"data: [DONE]\n\n"


async def _choice_deltas(call: Call, queue, tokenizer, index: int, res: Result, tail: dict):
    """Choice `index`'s delta choices (one per parser delta; the first carries the logprobs of the
    tokens since the last chunk). Fills `res` and `tail` (logprobs left for the finish chunk, and
    whether a tool call was streamed); yields {"error": message} if the generation fails."""
    b = call.body
    want_lp = bool(b.get("logprobs"))
    as_ids = bool(b.get("return_tokens_as_token_ids"))
    parser = new_stream_parser(call)
    pending = []
    saw_tool = False
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield {"error": f"generation failed: {ev.error}"}
            return
        if ev.step is not None:
            res.steps.append(ev.step)
            res.text += ev.text
            pending.append(ev.step)
        if ev.kind == "done":
            res.finish_reason, res.stop_reason = ev.finish_reason, ev.stop_reason
        deltas = parser.feed(res.text, final=ev.kind == "done")
        for i, d in enumerate(deltas):
            saw_tool = saw_tool or "tool_call" in d
            lp = None
            if want_lp and i == 0 and pending:
                lp = {"content": chat_logprob_entries(tokenizer, pending, as_ids, True)}
                pending = []
            yield {"index": index, "delta": _delta(d), "logprobs": lp, "finish_reason": None, "matched_stop": None}
        if ev.kind == "done":
            break
    tail["saw_tool"] = saw_tool
    tail["logprobs"] = {"content": chat_logprob_entries(tokenizer, pending, as_ids, True)} if want_lp and pending else None


# -- /v1/completions ------------------------------------------------------------------------------
def completion_full(call: Call, res: Result, tokenizer, eos_ids) -> dict:
    b = call.body
    choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason,
              "matched_stop": _matched(res, eos_ids)}
    if b.get("logprobs") not in (None, False):
        choice["logprobs"] = legacy_logprobs(tokenizer, res.steps, False)
    if b.get("return_token_ids"):
        choice["prompt_token_ids"] = call.prompt_ids
        choice["token_ids"] = res.ids
    return {"id": call.request_id, "object": "text_completion", "created": call.created, "model": call.model_name,
            "choices": [choice], "usage": {"prompt_tokens": len(call.prompt_ids),
                                           "total_tokens": len(call.prompt_ids) + len(res.steps),
                                           "completion_tokens": len(res.steps), "prompt_tokens_details": None,
                                           "reasoning_tokens": 0}, "metadata": None}


async def completion_stream(call: Call, queue, tokenizer, eos_ids):
    b = call.body
    head = {"id": call.request_id, "object": "text_completion", "created": call.created, "model": call.model_name}
    want_ids = bool(b.get("return_token_ids"))
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    res = Result()
    first = True
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield _sse(error_body(f"generation failed: {ev.error}", "InternalServerError", 500))
            return
        if ev.step is not None:
            res.steps.append(ev.step)
            res.text += ev.text
        choice = {"index": 0, "text": ev.text, "logprobs": None, "finish_reason": None, "matched_stop": None}
        if ev.kind == "done":
            res.finish_reason, res.stop_reason = ev.finish_reason, ev.stop_reason
            choice["finish_reason"], choice["matched_stop"] = res.finish_reason, _matched(res, eos_ids)
        if want_ids:
            if first:
                choice["prompt_token_ids"] = call.prompt_ids
            choice["token_ids"] = [ev.step.token_id] if ev.step is not None else []
        first = False
        yield _sse(dict(head, choices=[choice], usage=None))
        if ev.kind == "done":
            break
    if usage_on:
        yield _sse(dict(head, choices=[], usage={"prompt_tokens": len(call.prompt_ids),
                                                 "total_tokens": len(call.prompt_ids) + len(res.steps),
                                                 "completion_tokens": len(res.steps), "prompt_tokens_details": None,
                                                 "reasoning_tokens": 0}))
    yield b"data: [DONE]\n\n"


# -- native /generate -------------------------------------------------------------------------------
def generate_out(call: Call, res: Result, weight_version: str, eos_ids, started: float, logprob: bool,
                 with_prompt_ids: bool) -> dict:
    meta = meta_info(call, res, weight_version, eos_ids, started)
    if logprob:
        meta["output_token_logprobs"] = [[s.logprob, s.token_id, None] for s in res.steps]
        meta["input_token_logprobs"] = []
    out = {"text": res.text, "output_ids": res.ids, "meta_info": meta}
    if with_prompt_ids:
        out["prompt_token_ids"] = call.prompt_ids
    return out


class SGLang(Dialect):
    name = "sglang"
    render = SGLANG_RENDER
    split_reasoning = staticmethod(parsers.split_reasoning_sglang)
    tool_start = parsers.TOOL_START + "\n"
    tool_end = "\n" + parsers.TOOL_END
    strips_text_before_tool_call = True
    skips_undeclared_tools = True
    lags_streamed_arguments = True
    chat_input_ids = True

    def split_tools(self, rest, tool_names, partial):
        return parsers.split_tools_sglang(rest, tool_names, partial)

    def tool_call_id(self) -> str:
        return f"call_{hex_id()[:24]}"

    def request_id(self, kind: str) -> str:
        return hex_id()

    def model_name(self, body: dict, served_name: str) -> str:
        return str(body.get("model", "default"))  # SGLang echoes any name

    def error_body(self, message: str, status: int, err_type: str | None) -> dict:
        return error_body(message, err_type or ("BadRequest" if status < 500 else "InternalServerError"), status)

    def check_chat(self, body: dict) -> None:
        check_chat(body)

    def chat_full(self, server, call, res, started):
        return chat_full(call, res, server.model.tokenizer, server.weight_version, server.model.eos_ids, started,
                         server.sglang_ids_field)

    def chat_stream(self, server, calls, queues, headers):
        return chat_stream(calls, queues, server.model.tokenizer, headers, server.model.eos_ids)

    def completion_full(self, server, call, res):
        return completion_full(call, res, server.model.tokenizer, server.model.eos_ids)

    def completion_stream(self, server, call, queue):
        return completion_stream(call, queue, server.model.tokenizer, server.model.eos_ids)

    def model_card(self, server, name, created):
        return {"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": name,
                "max_model_len": server.model.max_len}

    def extra_routes(self, server, router) -> None:
        router.add_post("/v1/tokenize", server.wrap(server.tokenize))
        router.add_post("/v1/detokenize", server.wrap(server.detokenize))
        router.add_post("/generate", server.wrap(server.generate))
        router.add_get("/get_model_info", server.wrap(server.model_info))
        router.add_get("/health_generate", server.wrap(server.health))
