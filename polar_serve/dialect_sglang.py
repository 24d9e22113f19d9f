"""SGLang 0.5.23 wire format: chat / completions / native /generate layouts, sglext, errors; and the
handlers of the routes only SGLang has (/generate, /get_model_info; registered by SGLang.extra_routes).

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

from aiohttp import web

from polar_recon.chat_render import SGLANG_RENDER, RequestError

from . import parsers
from .dialect import Dialect, hex_id
from .engine import Job
from .generation import (
    GenerationRequest,
    GenerationResult,
    chat_logprob_entries,
    legacy_logprobs,
    new_stream_parser,
    parse_result,
)
from .params import sampling_params, stop_list

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


def _logprob_entry(token: str, logprob: float, utf8: list[int]) -> dict:
    return {"token": token, "bytes": utf8, "logprob": logprob}  # SGLang's field order


def _reasoning_tokens(ids: list[int], tokenizer) -> int:
    """SGLang counts the reasoning tokens through `</think>` (0 when the output has none)."""
    end = tokenizer.convert_tokens_to_ids("</think>")
    return ids.index(end) + 1 if end in ids else 0


def _matched(res: GenerationResult) -> int | str | None:
    if res.finish_reason != "stop":
        return None
    if res.stop_reason is not None:
        return res.stop_reason
    return res.steps[-1].token_id if res.steps else None


def _usage(req: GenerationRequest, ids: list[int], tokenizer) -> dict:
    p, c = len(req.prompt_ids), len(ids)
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": None,
            "reasoning_tokens": _reasoning_tokens(ids, tokenizer) if req.thinking else 0}


def meta_info(req: GenerationRequest, res: GenerationResult, weight_version: str, started: float) -> dict:
    fr = {"type": res.finish_reason}
    m = _matched(res)
    if res.finish_reason == "length":
        fr["length"] = len(res.steps)
    elif m is not None:
        fr["matched"] = m
    return {"id": req.request_id, "finish_reason": fr, "prompt_tokens": len(req.prompt_ids),
            "weight_version": weight_version, "completion_tokens": len(res.steps), "cached_tokens": 0,
            "e2e_latency": round(time.time() - started, 6)}


def chat_full(req: GenerationRequest, res: GenerationResult, tokenizer, weight_version: str, started: float,
              ids_field: str = "response_token_ids") -> dict:
    b = req.body
    p = parse_result(req, res)
    tcs = None
    if p.tool_calls:
        tcs = [{"id": req.dialect.tool_call_id(), "index": i, "type": "function",
                "function": {"name": tc.name, "arguments": tc.arguments}} for i, tc in enumerate(p.tool_calls)]
    finish = "tool_calls" if tcs and res.finish_reason == "stop" else res.finish_reason
    msg = {"role": "assistant", "content": p.content, "reasoning_content": p.reasoning, "tool_calls": tcs}
    lp = None
    if b.get("logprobs"):
        lp = {"content": chat_logprob_entries(tokenizer, res.steps, bool(b.get("return_tokens_as_token_ids")),
                                                 _logprob_entry)}
    choice = {"index": 0, "message": msg, "logprobs": lp, "finish_reason": finish,
              "matched_stop": _matched(res)}
    if ids_field == "token_ids":
        # Later SGLang sources: return_token_ids gives `token_ids` and implies prompt_token_ids.
        if b.get("return_prompt_token_ids") or b.get("return_token_ids"):
            choice["prompt_token_ids"] = req.prompt_ids
        if b.get("return_token_ids"):
            choice["token_ids"] = res.ids
    else:
        if b.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = req.prompt_ids
        if b.get("return_token_ids"):
            choice["response_token_ids"] = res.ids
    if b.get("return_meta_info"):
        choice["meta_info"] = meta_info(req, res, weight_version, started)
    return {"id": req.request_id, "object": "chat.completion", "created": req.created, "model": req.model_name,
            "choices": [choice], "usage": _usage(req, res.ids, tokenizer), "metadata": None}


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


async def chat_stream(reqs: list[GenerationRequest], queues: list, tokenizer, headers):
    """One stream for n choices (n = len(reqs)). Like serving_chat.py: a choice's first chunk
    (role) when its output starts, its deltas (one chunk each), then, after all output, one finish
    chunk per choice, the sglext chunk (output_ids per choice) and the usage chunk. Our engine
    generates the choices one after the other, so their chunks come in index order."""
    req = reqs[0]
    b = req.body
    head = {"id": req.request_id, "object": "chat.completion.chunk", "created": req.created, "model": req.model_name}
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    in_ids = _flag(b, headers, "return_input_ids_in_sglext", "x-sglext-return-input-ids")
    out_ids = _flag(b, headers, "return_output_ids_in_sglext", "x-sglext-return-output-ids")
    framed = headers.get("x-sglext-ids-framed", "").strip().lower() in ("1", "true", "yes")

    def chunk(choices, usage=None, **extra):
        return dict(head, choices=choices, usage=usage, **extra)

    results, finishes = [], []
    for i, (c, q) in enumerate(zip(reqs, queues, strict=True)):
        yield _sse(chunk([{"index": i, "delta": dict(_empty_delta(), role="assistant", content=""), "logprobs": None,
                           "finish_reason": None, "matched_stop": None}]))
        res, tail = GenerationResult(), {}
        async for choice in _choice_deltas(c, q, tokenizer, i, res, tail):
            if "error" in choice:
                yield _sse(error_body(choice["error"], "InternalServerError", 500))
                return
            yield _sse(chunk([choice]))
        results.append(res)
        finishes.append(tail)
    for i, (res, tail) in enumerate(zip(results, finishes, strict=True)):
        finish = "tool_calls" if tail["saw_tool"] and res.finish_reason == "stop" else res.finish_reason
        yield _sse(chunk([{"index": i, "delta": _empty_delta(), "logprobs": tail["logprobs"], "finish_reason": finish,
                           "matched_stop": _matched(res)}]))
    if in_ids or out_ids:
        ext = {}
        if in_ids:
            ext["input_ids"] = req.prompt_ids
        if out_ids:
            ext["output_ids"] = [r.ids for r in results]
        body = chunk([], sglext=ext)
        if framed:
            yield b"event: sglext_ids\n" + _sse(body)
        else:
            yield _sse(body)
    if usage_on:
        u = _usage(req, results[0].ids, tokenizer)
        for r in results[1:]:  # the prompt counts once; completions and reasoning add up
            more = _usage(req, r.ids, tokenizer)
            u["completion_tokens"] += more["completion_tokens"]
            u["reasoning_tokens"] += more["reasoning_tokens"]
        u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
        yield _sse(chunk([], usage=u))
    yield b"data: [DONE]\n\n"


async def _choice_deltas(req: GenerationRequest, queue, tokenizer, index: int, res: GenerationResult, tail: dict):
    """Choice `index`'s delta choices (one per parser delta; the first carries the logprobs of the
    tokens since the last chunk). Fills `res` and `tail` (logprobs left for the finish chunk, and
    whether a tool call was streamed); yields {"error": message} if the generation fails."""
    b = req.body
    want_lp = bool(b.get("logprobs"))
    as_ids = bool(b.get("return_tokens_as_token_ids"))
    parser = new_stream_parser(req)
    pending = []
    saw_tool = False
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield {"error": f"generation failed: {ev.error}"}
            return
        res.add(ev)
        if ev.step is not None:
            pending.append(ev.step)
        deltas = parser.feed(res.text, final=ev.kind == "done")
        for i, d in enumerate(deltas):
            saw_tool = saw_tool or "tool_call" in d
            lp = None
            if want_lp and i == 0 and pending:
                lp = {"content": chat_logprob_entries(tokenizer, pending, as_ids, _logprob_entry)}
                pending = []
            yield {"index": index, "delta": _delta(d), "logprobs": lp, "finish_reason": None, "matched_stop": None}
        if ev.kind == "done":
            break
    tail["saw_tool"] = saw_tool
    tail["logprobs"] = None
    if want_lp and pending:
        tail["logprobs"] = {"content": chat_logprob_entries(tokenizer, pending, as_ids, _logprob_entry)}


# -- /v1/completions ------------------------------------------------------------------------------
def completion_full(req: GenerationRequest, res: GenerationResult, tokenizer) -> dict:
    b = req.body
    choice = {"index": 0, "text": res.text, "logprobs": None, "finish_reason": res.finish_reason,
              "matched_stop": _matched(res)}
    if b.get("logprobs") not in (None, False):
        choice["logprobs"] = legacy_logprobs(tokenizer, res.steps, False)
    if b.get("return_token_ids"):
        choice["prompt_token_ids"] = req.prompt_ids
        choice["token_ids"] = res.ids
    return {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model_name,
            "choices": [choice], "usage": {"prompt_tokens": len(req.prompt_ids),
                                           "total_tokens": len(req.prompt_ids) + len(res.steps),
                                           "completion_tokens": len(res.steps), "prompt_tokens_details": None,
                                           "reasoning_tokens": 0}, "metadata": None}


async def completion_stream(req: GenerationRequest, queue):
    b = req.body
    head = {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model_name}
    want_ids = bool(b.get("return_token_ids"))
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    res = GenerationResult()
    first = True
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield _sse(error_body(f"generation failed: {ev.error}", "InternalServerError", 500))
            return
        res.add(ev)
        choice = {"index": 0, "text": ev.text, "logprobs": None, "finish_reason": None, "matched_stop": None}
        if ev.kind == "done":
            choice["finish_reason"], choice["matched_stop"] = res.finish_reason, _matched(res)
        if want_ids:
            if first:
                choice["prompt_token_ids"] = req.prompt_ids
            choice["token_ids"] = [ev.step.token_id] if ev.step is not None else []
        first = False
        yield _sse(dict(head, choices=[choice], usage=None))
        if ev.kind == "done":
            break
    if usage_on:
        yield _sse(dict(head, choices=[], usage={"prompt_tokens": len(req.prompt_ids),
                                                 "total_tokens": len(req.prompt_ids) + len(res.steps),
                                                 "completion_tokens": len(res.steps), "prompt_tokens_details": None,
                                                 "reasoning_tokens": 0}))
    yield b"data: [DONE]\n\n"


# -- native /generate -------------------------------------------------------------------------------
def generate_out(req: GenerationRequest, res: GenerationResult, weight_version: str, started: float, logprob: bool,
                 with_prompt_ids: bool) -> dict:
    meta = meta_info(req, res, weight_version, started)
    if logprob:
        meta["output_token_logprobs"] = [[s.logprob, s.token_id, None] for s in res.steps]
        meta["input_token_logprobs"] = []
    out = {"text": res.text, "output_ids": res.ids, "meta_info": meta}
    if with_prompt_ids:
        out["prompt_token_ids"] = req.prompt_ids
    return out


async def generate(server, request):
    """POST /generate: `text` or `input_ids` continued with SGLang's native `sampling_params`."""
    body = await server.body(request)
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise RequestError("'sampling_params' must be an object")
    tok = server.model.tokenizer
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(x, int) for x in ids):
            raise RequestError("'input_ids' must be a non-empty list of token ids (batches are not supported)")
        text = tok.decode(ids)
    elif isinstance(body.get("text"), str):
        text = body["text"]
        ids = tok.encode(text, add_special_tokens=False)
    else:
        raise RequestError("/generate needs 'text' (a string) or 'input_ids' (a list of ints)")
    # The native sampling_params under the OpenAI names sampling_params() validates.
    openai = {"temperature": sp.get("temperature"), "top_p": sp.get("top_p"), "top_k": sp.get("top_k"),
              "min_p": sp.get("min_p"), "max_tokens": sp.get("max_new_tokens", 128), "seed": sp.get("sampling_seed"),
              "stop": sp.get("stop"), "stop_token_ids": sp.get("stop_token_ids"), "ignore_eos": sp.get("ignore_eos")}
    params = sampling_params(openai, server.model.gen_defaults, server.model.max_len, len(ids), chat=False)
    job = Job(ids, params, stop=stop_list(openai))
    req = GenerationRequest(body, server.dialect, server.served_name, hex_id(), int(time.time()), ids, text, job,
                            thinking=False)
    started = time.time()
    q = server.engine.stream(job)
    lp = bool(body.get("return_logprob"))
    with_ids = bool(body.get("return_prompt_token_ids"))
    if body.get("stream"):
        return await server.sse(request, _generate_stream(server, req, q, lp, with_ids, started), job)
    res = await server.collect(job, q)
    return server.answer(generate_out(req, res, server.weight_version, started, lp, with_ids))


async def _generate_stream(server, req: GenerationRequest, queue, lp: bool, with_ids: bool, started: float):
    res = GenerationResult()
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield _sse(error_body(f"generation failed: {ev.error}", "InternalServerError", 500))
            return
        res.add(ev)
        out = generate_out(req, res, server.weight_version, started, lp, with_ids)
        if ev.kind != "done":
            out["meta_info"]["finish_reason"] = None
        yield _sse(out)
        if ev.kind == "done":
            break
    yield b"data: [DONE]\n\n"


async def model_info(server, request):
    """GET /get_model_info."""
    path = str(server.model.model_dir)
    return web.json_response({"model_path": path, "tokenizer_path": path, "is_generation": True,
                              "weight_version": server.weight_version})


class SGLang(Dialect):
    name = "sglang"
    render = SGLANG_RENDER
    tool_start = parsers.TOOL_START + "\n"
    tool_end = "\n" + parsers.TOOL_END
    strips_text_before_tool_call = True
    skips_undeclared_tools = True
    lags_streamed_arguments = True
    chat_input_ids = True

    def __init__(self, token_ids_field: str = "response_token_ids"):
        self.token_ids_field = token_ids_field  # the chat choice's output-ids field (see the module doc)

    def configured(self, options) -> SGLang:
        return SGLang(options.sglang_token_ids_field)

    def split_reasoning(self, text, thinking):
        return parsers.split_reasoning_sglang(text, thinking)

    def split_tools(self, rest, tool_names, partial):
        return parsers.split_tools_sglang(rest, tool_names, partial)

    def tool_call_id(self) -> str:
        return f"call_{hex_id()[:24]}"

    def chat_id(self) -> str:
        return hex_id()

    def completion_id(self) -> str:
        return hex_id()

    def model_name(self, body: dict, served_name: str) -> str:
        return str(body.get("model", "default"))  # SGLang echoes any name

    def error_body(self, message: str, status: int, err_type: str | None) -> dict:
        return error_body(message, err_type or ("BadRequest" if status < 500 else "InternalServerError"), status)

    def check_chat(self, body: dict) -> None:
        check_chat(body)

    def chat_full(self, server, req, res, started):
        return chat_full(req, res, server.model.tokenizer, server.weight_version, started, self.token_ids_field)

    def chat_stream(self, server, reqs, queues, headers):
        return chat_stream(reqs, queues, server.model.tokenizer, headers)

    def completion_full(self, server, req, res):
        return completion_full(req, res, server.model.tokenizer)

    def completion_stream(self, server, req, queue):
        return completion_stream(req, queue)

    def model_card(self, server, name, created):
        return {"id": name, "object": "model", "created": created, "owned_by": "sglang", "root": name,
                "max_model_len": server.model.max_len}

    def extra_routes(self, server, router) -> None:
        router.add_post("/v1/tokenize", server.wrap(server.tokenize))
        router.add_post("/v1/detokenize", server.wrap(server.detokenize))
        router.add_post("/generate", server.wrap(lambda request: generate(server, request)))
        router.add_get("/get_model_info", server.wrap(lambda request: model_info(server, request)))
        router.add_get("/health_generate", server.wrap(server.health))
