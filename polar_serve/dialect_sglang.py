"""SGLang 0.5.23 wire format: chat / completions / native /generate layouts, sglext, errors; and the
handlers of the routes only SGLang has (/generate, /get_model_info; registered by SGLang.extra_routes).

Followed: `srt/entrypoints/openai/protocol.py` (ChatMessage, ChatCompletionResponseChoice with its
serializer dropping unset id fields, DeltaMessage, ChatCompletionStreamResponse with `sglext`,
ToolCall {id, index, type, function}, UsageInfo with completion_tokens_details), `serving_chat.py`
`_generate_chat_stream` / `_generate_stream_content` and `sse_utils.py` (the role, reasoning,
plain-content, logprob-only and finish chunks are msgspec structs: no `usage` key, delta
`{reasoning_content, role?, content?}`; the tool-call path's chunks, sglext and usage are pydantic
dumps; a step's logprobs ride its reasoning or plain-content chunk, else a chunk of their own with
delta `{"reasoning_content": null}`; the finish chunk carries none), `_build_chat_response`
(content "" not null, tool_calls left out when none, `return_token_ids` implies the prompt ids,
`metadata: {weight_version}`),
`srt/managers/io_struct.py` (GenerateReqInput), as docs/reference.md "Wire formats" records them:
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

from polar_contracts.chat.render import SGLANG_RENDER, RequestError
from polar_serve.dialect_base import Dialect, hex_id

from . import parsers
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


def usage_info(prompt: int, completion: int, reasoning: int = 0) -> dict:
    """protocol.UsageInfo as usage_processor.calculate_token_usage fills it."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": None, "reasoning_tokens": reasoning,
            "completion_tokens_details": {"reasoning_tokens": reasoning} if reasoning else None}


def _usage(req: GenerationRequest, ids: list[int], tokenizer) -> dict:
    return usage_info(len(req.prompt_ids), len(ids), _reasoning_tokens(ids, tokenizer) if req.thinking else 0)


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
    # ChatMessage: content "" rather than null, reasoning null when empty, tool_calls left out when none
    msg = {"role": "assistant", "content": p.content or "", "reasoning_content": p.reasoning or None}
    if tcs:
        msg["tool_calls"] = tcs
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
    else:  # 0.5.23 _build_chat_response: return_token_ids implies the prompt ids too
        if b.get("return_prompt_token_ids") or b.get("return_token_ids"):
            choice["prompt_token_ids"] = req.prompt_ids
        if b.get("return_token_ids"):
            choice["response_token_ids"] = res.ids
    if b.get("return_meta_info"):
        choice["meta_info"] = meta_info(req, res, weight_version, started)
    return {"id": req.request_id, "object": "chat.completion", "created": req.created, "model": req.model_name,
            "choices": [choice], "usage": _usage(req, res.ids, tokenizer), "metadata": {"weight_version": weight_version}}


def _flag(body: dict, headers, field: str, header: str) -> bool:
    return bool(body.get(field)) or headers.get(header) == "1"  # _convert_to_internal_request: exactly "1"


def _sse_delta(role: str | None = None, content: str | None = None, reasoning: str | None = None) -> dict:
    """sse_utils.StreamDelta (msgspec, omit_defaults): `reasoning_content` always, role / content
    only when set, in that field order."""
    out: dict = {"reasoning_content": reasoning}
    if role is not None:
        out["role"] = role
    if content is not None:
        out["content"] = content
    return out


def _model_delta(content: str | None = None, tool_call: dict | None = None) -> dict:
    """protocol.DeltaMessage dumped by pydantic (the tool-call parser's chunks): every field, null
    ones too, `tool_calls` only when set."""
    out: dict = {"role": None, "content": content, "reasoning_content": None}
    if tool_call is not None:
        named = "name" in tool_call
        out["tool_calls"] = [{"id": tool_call.get("id") if named else None, "index": tool_call["index"],
                              "type": "function", "function": {"name": tool_call.get("name") if named else None,
                                                               "arguments": "" if named else tool_call["arguments"]}}]
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
    framed = headers.get("x-sglext-ids-framed") == "1"

    def chunk(choices, usage=None, **extra):  # a pydantic ChatCompletionStreamResponse dump
        return dict(head, choices=choices, usage=usage, **extra)

    results, finishes = [], []
    for i, (c, q) in enumerate(zip(reqs, queues, strict=True)):
        yield _sse(dict(head, choices=[_choice(i, _sse_delta(role="assistant", content=""))]))
        res, tail = GenerationResult(), {}
        async for out in _choice_chunks(c, q, tokenizer, i, res, tail, head):
            if "error" in out:
                yield _sse(error_body(out["error"], "InternalServerError", 500))
                return
            yield _sse(out)
        results.append(res)
        finishes.append(tail)
    for i, (res, tail) in enumerate(zip(results, finishes, strict=True)):
        finish = "tool_calls" if tail["saw_tool"] and res.finish_reason == "stop" else res.finish_reason
        yield _sse(dict(head, choices=[_choice(i, _sse_delta(), finish=finish, matched=_matched(res))]))
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
        # calculate_streaming_usage: the prompt counts once; completions and reasoning add up
        us = [_usage(req, r.ids, tokenizer) for r in results]
        u = usage_info(len(req.prompt_ids), sum(x["completion_tokens"] for x in us), sum(x["reasoning_tokens"] for x in us))
        yield _sse(chunk([], usage=u))
    yield b"data: [DONE]\n\n"


def _choice(index: int, delta: dict, logprobs=None, finish=None, matched=None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched}


async def _choice_chunks(req: GenerationRequest, queue, tokenizer, index: int, res: GenerationResult, tail: dict,
                         head: dict):
    """Choice `index`'s chunks, step by step as serving_chat.py `_generate_stream_content` makes
    them (a reasoning and a tool-call parser configured, as for Qwen3): the reasoning text of a
    step in one sse_utils chunk carrying the step's logprobs; answer text in one sse_utils chunk
    with the logprobs too when no tool-call parsing is active, else in pydantic chunks (content,
    then each tool-call delta) that carry none; logprobs still unattached after that (a step with
    no text: `<think>`, `</think>`, `<|im_end|>`, or a tool-call step) in a chunk of their own whose
    delta is `{"reasoning_content": null}`. Fills `res` and `tail` (whether a tool call was
    streamed); yields {"error": message} if the generation fails."""
    b = req.body
    want_lp = bool(b.get("logprobs"))
    as_ids = bool(b.get("return_tokens_as_token_ids"))
    parser = new_stream_parser(req)
    saw_tool = False
    while True:
        ev = await queue.get()
        if ev.kind == "error":
            yield {"error": f"generation failed: {ev.error}"}
            return
        res.add(ev)
        lp = None
        if want_lp and ev.step is not None:
            lp = {"content": chat_logprob_entries(tokenizer, [ev.step], as_ids, _logprob_entry)}
        deltas = parser.feed(res.text, final=ev.kind == "done")
        reasoning = "".join(d["reasoning"] for d in deltas if "reasoning" in d)
        if reasoning:
            yield dict(head, choices=[_choice(index, _sse_delta(reasoning=reasoning), lp)])
            lp = None
        if req.tools_active:
            for d in deltas:
                if "content" in d and d["content"]:
                    yield dict(head, choices=[_choice(index, _model_delta(content=d["content"]))], usage=None)
                elif "tool_call" in d:
                    saw_tool = True
                    yield dict(head, choices=[_choice(index, _model_delta(tool_call=d["tool_call"]))], usage=None)
        else:
            content = "".join(d["content"] for d in deltas if "content" in d and d["content"])
            if content:
                yield dict(head, choices=[_choice(index, _sse_delta(content=content), lp)])
                lp = None
        if lp is not None:
            yield dict(head, choices=[_choice(index, _sse_delta(), lp)])
        if ev.kind == "done":
            break
    tail["saw_tool"] = saw_tool


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
            "choices": [choice], "usage": usage_info(len(req.prompt_ids), len(res.steps)), "metadata": None}


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
        yield _sse(dict(head, choices=[], usage=usage_info(len(req.prompt_ids), len(res.steps))))
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
    """GET /model_info and the deprecated GET /get_model_info (entrypoints/http_server.py:802-850),
    field for field: ``model_path`` is the directory the weights were loaded from (a proxy reads the
    model's generation_config.json there: the sampling defaults SGLang applies, its default
    ``--sampling-defaults model``); ``weight_version`` is SGLang's ``--weight-version`` ("default")
    until a weight update names another (arg_groups/fields/serving.py:172-175);
    ``preferred_sampling_params`` is ``--preferred-sampling-params`` (unset: null); the parsers
    polar-serve runs are SGLang's names for them; single-node, text only."""
    path = str(server.model.model_dir)
    cfg = getattr(getattr(server.model, "hf", None), "config", None)
    return web.json_response({
        "model_path": path, "served_model_name": server.served_name, "tokenizer_path": path,
        "is_generation": True, "preferred_sampling_params": None, "weight_version": server.weight_version,
        "load_format": "auto", "reasoning_parser": "qwen3", "tool_call_parser": "qwen25",
        "disaggregation_mode": "null", "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": getattr(cfg, "model_type", None), "architectures": getattr(cfg, "architectures", None)})


async def update_weights_from_disk(server, request):
    """POST /update_weights_from_disk as SGLang 0.5.23 answers it: entrypoints/http_server.py:1300-1327
    (``{"success", "message", "num_paused_requests"}``, 200 or 400), managers/io_struct.py:1970-1999
    (UpdateWeightFromDiskReqInput: ``model_path`` required, ``weight_version`` optional; the other
    fields are GPU/scheduler knobs polar-serve accepts and ignores), managers/tokenizer_manager.py:
    2288-2322 (the version moves only on success, and the message then says so) and
    model_runner_components/weight_updater.py:174-258 (the messages; a failed load leaves the old
    weights: polar-serve loads the new model before swapping it in). SGLang waits for running
    requests (its model_update_lock); polar-serve's worker thread finishes the running one first."""
    body = await server.body(request)
    path, version = body.get("model_path"), body.get("weight_version")
    if not isinstance(path, str):  # pydantic's validation error, which SGLang answers with 400
        raise RequestError(f"model_path: Input should be a valid string (got {path!r})")
    if version is not None and not isinstance(version, str):
        raise RequestError(f"weight_version: Input should be a valid string (got {version!r})")
    try:
        await server.engine.run_sync(lambda m: m.load(path))
    except Exception as e:  # noqa: BLE001 - SGLang answers any loader failure with success false
        return server.json({"success": False, "message": f"Failed to get weights iterator: {e}.",
                            "num_paused_requests": 0}, status=400)
    server.reloads += 1
    message = "Succeeded to update model weights."
    if version is not None:
        server.weight_version = version
        message += f" Weight version updated to {version}."
    return server.json({"success": True, "message": message, "num_paused_requests": 0})


async def update_weight_version(server, request):
    """POST /update_weight_version {"new_version"} (entrypoints/http_server.py:1527-1555)."""
    body = await server.body(request)
    v = body.get("new_version")
    if not isinstance(v, str):
        raise RequestError(f"new_version: Input should be a valid string (got {v!r})")
    server.weight_version = v
    return server.json({"success": True, "message": f"Weight version updated to {v}", "new_version": v})


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

    def chat_answer(self, server, reqs, results, started, prompt_logprobs=None):
        out = super().chat_answer(server, reqs, results, started, prompt_logprobs)
        u = out["usage"]  # (n > 1: summed; completion_tokens_details follows the sum)
        out["usage"] = usage_info(u["prompt_tokens"], u["completion_tokens"], u["reasoning_tokens"])
        return out

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
        router.add_get("/model_info", server.wrap(lambda request: model_info(server, request)))
        router.add_post("/update_weights_from_disk", server.wrap(lambda request: update_weights_from_disk(server, request)))
        router.add_post("/update_weight_version", server.wrap(lambda request: update_weight_version(server, request)))
        router.add_get("/health_generate", server.wrap(server.health))
