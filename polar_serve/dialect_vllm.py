"""vLLM wire format, checked on the real vLLM 0.32.0: JSON of chat / completions answers, stream
chunks, errors, /v1/models, /tokenize, /detokenize, /version.

Read from the 0.32.0 sources (`entrypoints/openai/chat_completion/serving.py` and `protocol.py`,
`completion/serving.py`, `v1/engine/logprobs.py`, `renderers/hf.py`) and checked field by field,
chunk by chunk against the running server by tests/vllm/test_differential.py:
- JSON is pydantic's: compact, non-ASCII as is, `application/json` (no charset).
- Non-streaming answers are full dumps (every field, nulls included): top level ends with
  `kv_transfer_params, ec_transfer_params, metrics`; choices end with `routed_experts`;
  `system_fingerprint` is `vllm-0.32.0-<8 hex>`; chat usage has `completion_tokens_details:
  {"reasoning_tokens": N}` (completions: null); `message.tool_calls` is dropped when empty,
  whitespace-only content before a tool call is null; an empty reasoning is null.
- Chat streams: per choice a first chunk `delta {role, content: ""}` with top-level
  `prompt_token_ids` (ids or null) and `prompt_text`; then one chunk per token (none for a token
  without delta unless ids or logprobs were asked for), no `kv_transfer_params`; the finishing chunk
  adds `stop_reason` and, without include_usage, `system_fingerprint`; the usage chunk is an
  exclude_none dump (`completion_tokens_details`, then `system_fingerprint`). Tool-call arguments
  stream as the raw text of each token (trailing whitespace held back).
- Completions streams: every chunk carries `prompt_token_ids` (the first when asked for, else null)
  and `token_ids` (null unless asked for); echo prepends the prompt text ("" with return_token_ids)
  to the first chunk and its logprobs cover prompt + first token.
- n > 1: one answer with n choices; streams interleave the choices token by token.
- Logprobs: the position's dict holds the sampled token first, then the top-k (no repeats); chat
  cuts it at k, completions at k + 1; a token ending in an incomplete UTF-8 character is decoded
  with up to 4 preceding sampled tokens ("" when it completes nothing); `bytes` are those of the
  decoded token even with `return_tokens_as_token_ids`; text_offset advances by the token strings.
- Errors: `{"error": {"message", "type", "param", "code"}}`; field errors name `param` and end in
  `(parameter=..., value=...)`; unknown routes answer FastAPI's `{"detail": ...}`.
"""
from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

from polar_contracts.chat.render import VLLM_RENDER, RequestError
from polar_serve.dialect_base import Dialect

from . import parsers
from .generation import GenerationRequest, GenerationResult, new_stream_parser, parse_result
from .model import LOGPROB_FLOOR

VLLM_VERSION = "0.32.0"  # the real server every layout here was checked against (tests/vllm/test_differential.py)


def random_uuid() -> str:
    """16 hex digits (vllm.utils.random_uuid)."""
    return f"{uuid.uuid4().int & ((1 << 64) - 1):016x}"


def error_body(message: str, err_type: str = "BadRequestError", status: int = 400, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def dumps(obj) -> bytes:
    """pydantic's JSON: compact, non-ASCII as is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _sse(obj: dict) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def _usage(p: int, c: int, details) -> dict:
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": None,
            "completion_tokens_details": details}


def _tool_call(tc) -> dict:
    return {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments}}


# -- logprobs (vllm/v1/engine/logprobs.py, chat_completion/serving.py _create_chat_logprobs,
#    completion/serving.py _create_completion_logprobs) ----------------------------------------------
def _decode_one(tokenizer, tid: int, context: list[int]) -> str:
    """vLLM's decoded_token: the token alone, or, when that ends in an incomplete UTF-8 character,
    the text it completes after up to 4 preceding sampled tokens ("" when it completes nothing)."""
    text = tokenizer.decode([tid])
    if not text.endswith("\ufffd"):
        return text
    ctx = context[-4:]
    for n in range(1, len(ctx) + 1):
        c = ctx[-n:]
        full = tokenizer.decode(c + [tid])
        if full.endswith("\ufffd"):
            continue
        clean_end = len(c)
        for j in range(len(c) - 1, -1, -1):
            if tokenizer.decode([c[j]]).endswith("\ufffd"):
                clean_end = j
            else:
                break
        prefix = tokenizer.decode(c[:clean_end]) if clean_end > 0 else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""


def _position(tokenizer, tid: int, lp: float, top, context: list[int]) -> list[tuple[int, float, str]]:
    """One position's logprob dict as vLLM builds it: the chosen token first, then the top-k in
    order, a token already present not repeated; each with its decoded text."""
    out, seen = [], set()
    for i, v in [(tid, lp), *top]:
        if i not in seen:
            seen.add(i)
            out.append((i, max(v, LOGPROB_FLOOR), _decode_one(tokenizer, i, context)))
    return out


def _token(tid: int, text: str, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else text


def chat_logprobs(tokenizer, steps, k: int, as_ids: bool, context: list[int]) -> dict:
    """`logprobs` of a chat choice (or chunk); `context`: the sampled ids before `steps`."""
    ctx = list(context)
    content = []
    for st in steps:
        pos = _position(tokenizer, st.token_id, st.logprob, st.top, ctx)
        tid, lp, text = pos[0]
        content.append({"token": _token(tid, text, as_ids), "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": (t := _token(i, x, as_ids)), "logprob": v,
                                          "bytes": list(t.encode("utf-8", errors="replace"))}
                                         for i, v, x in pos[:k]]})
        ctx.append(st.token_id)
    return {"content": content}


def _prompt_positions(tokenizer, prompt_ids: list[int], plp) -> list:
    """[None, position dict entries...] for the prompt (model.prompt_logprobs output)."""
    out: list = [None]
    ctx: list[int] = []
    for tok, lp, rank, top in plp:
        pos = _position(tokenizer, tok, lp, top, ctx)
        out.append([(i, v, x, rank if n == 0 else _top_rank(top, i)) for n, (i, v, x) in enumerate(pos)])
        ctx.append(tok)
    return out


def _top_rank(top, tid: int) -> int:
    return next(r for r, (i, _) in enumerate(top, 1) if i == tid)


def prompt_logprobs_json(positions) -> list | None:
    if positions is None:
        return None
    return [None if p is None else {str(i): {"logprob": v, "rank": r, "decoded_token": x} for i, v, x, r in p}
            for p in positions]


def completion_logprobs(tokenizer, entries, k: int, as_ids: bool, offset0: int = 0) -> dict:
    """The legacy `logprobs` object. `entries`: per token, (token id, position list or None)."""
    offs, lps, toks, tops = [], [], [], []
    last = 0
    for tid, pos in entries:
        if pos is None:
            t = f"token_id:{tid}" if as_ids else tokenizer.decode([tid])
            toks.append(t)
            lps.append(None)
            tops.append(None)
        else:
            t = _token(pos[0][0], pos[0][2], as_ids)
            toks.append(t)
            lps.append(pos[0][1])
            tops.append({_token(i, x, as_ids): v for n, (i, v, x, *_) in enumerate(pos) if n <= k})
        offs.append(offset0 if not offs else offs[-1] + last)
        last = len(t)
    return {"text_offset": offs, "token_logprobs": lps, "tokens": toks, "top_logprobs": tops}


def _sample_positions(tokenizer, steps, context: list[int]) -> list:
    ctx = list(context)
    out = []
    for st in steps:
        out.append((st.token_id, _position(tokenizer, st.token_id, st.logprob, st.top, ctx)))
        ctx.append(st.token_id)
    return out


# -- chat -------------------------------------------------------------------------------------------
def _reasoning_tokens(req: GenerationRequest, ids: list[int], tokenizer) -> int:
    """vLLM's qwen3 parser count: the tokens inside <think>...</think> (all of them when thinking is
    on and the output never closes the block)."""
    if not req.thinking:
        return 0
    start, end = tokenizer.convert_tokens_to_ids("<think>"), tokenizer.convert_tokens_to_ids("</think>")
    n = 0
    for t in ids:
        if t == end:
            break
        if t != start:
            n += 1
    return n


def chat_choice(req: GenerationRequest, res: GenerationResult, tokenizer, index: int) -> tuple[dict, int]:
    b = req.body
    p = parse_result(req, res)
    for tc in p.tool_calls:
        tc.id = req.dialect.tool_call_id()
    content = p.content or None
    if p.tool_calls and content is not None and not content.strip():
        content = None  # whitespace before a tool call (the parser engine strips it)
    msg = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
           "function_call": None}
    if p.tool_calls:
        msg["tool_calls"] = [_tool_call(tc) for tc in p.tool_calls]
    # include_reasoning=false hides the reasoning AND the per-token metadata (docs/reference.md, "Wire formats").
    hide = b.get("include_reasoning", True) is False
    msg["reasoning"] = None if hide else (p.reasoning or None)
    finish = "tool_calls" if p.tool_calls and not _named_tool(b) else res.finish_reason
    lp = None
    if b.get("logprobs") and not hide:
        lp = chat_logprobs(tokenizer, res.steps, int(b.get("top_logprobs") or 0),
                           bool(b.get("return_tokens_as_token_ids")), [])
    choice = {"index": index, "message": msg, "logprobs": lp, "finish_reason": finish, "stop_reason": res.stop_reason,
              "token_ids": res.ids if b.get("return_token_ids") and not hide else None, "routed_experts": None}
    return choice, _reasoning_tokens(req, res.ids, tokenizer)


def _named_tool(b: dict) -> bool:
    return isinstance(b.get("tool_choice"), dict)


def chat_full(server, reqs: list[GenerationRequest], results: list[GenerationResult], plp=None) -> dict:
    tokenizer = server.model.tokenizer
    req = reqs[0]
    b = req.body
    choices, reasoning = [], 0
    for i, (r, res) in enumerate(zip(reqs, results, strict=True)):
        c, n = chat_choice(r, res, tokenizer, i)
        choices.append(c)
        reasoning += n
    completion = sum(len(res.steps) for res in results)
    positions = _prompt_positions(tokenizer, req.prompt_ids, plp) if plp is not None else None
    return {"id": req.request_id, "object": "chat.completion", "created": req.created, "model": req.model_name,
            "choices": choices, "service_tier": None, "system_fingerprint": server.dialect.fingerprint,
            "usage": _usage(len(req.prompt_ids), completion, {"reasoning_tokens": reasoning}),
            "prompt_logprobs": prompt_logprobs_json(positions),
            "prompt_token_ids": req.prompt_ids if b.get("return_token_ids") else None,
            "prompt_text": req.prompt_text if b.get("return_prompt_text") else None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


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


class _ChatChoiceStream:
    """One choice of a chat stream: turns its Events into chunks (serving.py chat_completion_stream_generator)."""

    def __init__(self, req: GenerationRequest, index: int, tokenizer):
        b = req.body
        self.req, self.index, self.tok = req, index, tokenizer
        self.hide = b.get("include_reasoning", True) is False  # vLLM's hide_stream_metadata
        self.want_ids = bool(b.get("return_token_ids")) and not self.hide
        self.want_lp = bool(b.get("logprobs")) and not self.hide
        self.k = int(b.get("top_logprobs") or 0)
        self.as_ids = bool(b.get("return_tokens_as_token_ids"))
        self.parser = new_stream_parser(req)
        self.text = ""
        self.ids: list[int] = []
        self.saw_tool = False
        self.done = False

    def feed(self, ev) -> dict | None:
        """The choice dict of the chunk this Event makes (None: no chunk)."""
        final = ev.kind == "done"
        steps = [ev.step] if ev.step is not None else []
        lp = chat_logprobs(self.tok, steps, self.k, self.as_ids, self.ids) if self.want_lp else None
        self.ids += [s.token_id for s in steps]
        self.text += ev.text
        deltas = self.parser.feed(self.text, final=final)
        self.saw_tool = self.saw_tool or any("tool_call" in d for d in deltas)
        if self.hide:
            deltas = [d for d in deltas if "reasoning" not in d]
        if not deltas and not final and lp is None and not self.want_ids:
            return None  # vLLM skips a token without a delta unless ids or logprobs were asked for
        choice = {"index": self.index, "delta": _merge(deltas) if deltas else {}, "logprobs": lp,
                  "finish_reason": None}
        if final:
            self.done = True
            tool = self.saw_tool and not _named_tool(self.req.body) and ev.finish_reason == "stop"
            choice["finish_reason"] = "tool_calls" if tool else (ev.finish_reason or "stop")
            choice["stop_reason"] = ev.stop_reason
        choice["token_ids"] = [s.token_id for s in steps] if self.want_ids else None
        return choice


async def chat_stream(server, reqs: list[GenerationRequest], queues: list):
    """One stream for n choices (n = len(reqs)): the first chunk of every choice (role, prompt ids)
    goes out before any token; then the choices' token chunks interleave, one engine step of each
    running choice in turn (the real server's cross-choice order varies with its timing)."""
    tokenizer = server.model.tokenizer
    req = reqs[0]
    b = req.body
    head = {"id": req.request_id, "object": "chat.completion.chunk", "created": req.created, "model": req.model_name}
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    fp = server.dialect.fingerprint
    for i in range(len(reqs)):
        first = dict(head, choices=[{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}],
                     prompt_token_ids=req.prompt_ids if b.get("return_token_ids") else None,
                     prompt_text=req.prompt_text if b.get("return_prompt_text") else None)
        yield _sse(first)
    states = [_ChatChoiceStream(r, i, tokenizer) for i, r in enumerate(reqs)]
    while not all(s.done for s in states):
        for s, q in zip(states, queues, strict=True):
            if s.done:
                continue
            ev = await q.get()
            if ev.kind == "error":
                yield _sse(error_body(f"generation failed: {ev.error}", "InternalServerError", 500))
                yield b"data: [DONE]\n\n"
                return
            choice = s.feed(ev)
            if choice is None:
                continue
            chunk = dict(head, choices=[choice])
            if choice["finish_reason"] is not None and not usage_on:
                chunk["system_fingerprint"] = fp
            yield _sse(chunk)
    if usage_on:
        p, c = len(req.prompt_ids), sum(len(s.ids) for s in states)
        reasoning = sum(_reasoning_tokens(s.req, s.ids, tokenizer) for s in states)
        u = {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c,
             "completion_tokens_details": {"reasoning_tokens": reasoning}}
        yield _sse(dict(head, choices=[], usage=u, system_fingerprint=fp))
    yield b"data: [DONE]\n\n"


# -- /v1/completions ------------------------------------------------------------------------------
def _want_lp(b: dict) -> bool:
    return b.get("logprobs") is not None and b.get("logprobs") is not False


def completion_full(server, reqs: list[GenerationRequest], results: list[GenerationResult], plp=None) -> dict:
    tokenizer = server.model.tokenizer
    req = reqs[0]
    b = req.body
    want_ids = bool(b.get("return_token_ids"))
    echo = bool(b.get("echo"))
    k = int(b.get("logprobs") or 0) if _want_lp(b) else 0
    as_ids = bool(b.get("return_tokens_as_token_ids"))
    positions = _prompt_positions(tokenizer, req.prompt_ids, plp) if plp is not None else None
    choices = []
    for i, res in enumerate(results):
        lp = None
        if _want_lp(b):
            entries = _completion_entries(tokenizer, req, positions, res.steps, [], echo)
            lp = completion_logprobs(tokenizer, entries, k, as_ids)
        prompt_text = "" if want_ids else req.prompt_text
        text = (prompt_text + res.text) if echo else res.text
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": res.finish_reason,
                        "stop_reason": res.stop_reason, "token_ids": res.ids if want_ids else None,
                        "prompt_logprobs": prompt_logprobs_json(positions),
                        "prompt_token_ids": req.prompt_ids if want_ids else None, "routed_experts": None})
    completion = sum(len(r.steps) for r in results)
    return {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model_name,
            "choices": choices, "service_tier": None, "system_fingerprint": server.dialect.fingerprint,
            "usage": _usage(len(req.prompt_ids), completion, None), "kv_transfer_params": None,
            "ec_transfer_params": None, "metrics": None}


def _completion_entries(tokenizer, req, positions, steps, context, with_prompt: bool) -> list:
    out = []
    if with_prompt and positions is not None:
        out += [(t, None if p is None else p) for t, p in zip(req.prompt_ids, positions, strict=True)]
    out += _sample_positions(tokenizer, steps, context)
    return out


async def completion_stream(server, reqs: list[GenerationRequest], queues: list, plp=None):
    tokenizer = server.model.tokenizer
    req = reqs[0]
    b = req.body
    head = {"id": req.request_id, "object": "text_completion", "created": req.created, "model": req.model_name}
    want_ids = bool(b.get("return_token_ids"))
    echo = bool(b.get("echo"))
    k = int(b.get("logprobs") or 0) if _want_lp(b) else 0
    as_ids = bool(b.get("return_tokens_as_token_ids"))
    usage_on = bool((b.get("stream_options") or {}).get("include_usage"))
    fp = server.dialect.fingerprint
    positions = _prompt_positions(tokenizer, req.prompt_ids, plp) if plp is not None else None
    n = len(reqs)
    ids: list[list[int]] = [[] for _ in range(n)]
    offsets = [0] * n
    started = [False] * n
    done = [False] * n
    while not all(done):
        for i, q in enumerate(queues):
            if done[i]:
                continue
            ev = await q.get()
            if ev.kind == "error":
                yield _sse(error_body(f"generation failed: {ev.error}", "InternalServerError", 500))
                yield b"data: [DONE]\n\n"
                return
            final = ev.kind == "done"
            steps = [ev.step] if ev.step is not None else []
            text = ev.text
            first = not started[i]
            started[i] = True
            lp = None
            if _want_lp(b):
                entries = _completion_entries(tokenizer, req, positions, steps, ids[i], echo and first)
                lp = completion_logprobs(tokenizer, entries, k, as_ids, offsets[i])
                if lp["tokens"]:
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if echo and first:
                text = ("" if want_ids else req.prompt_text) + text
            ids[i] += [s.token_id for s in steps]
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": ev.finish_reason if final else None,
                      "stop_reason": ev.stop_reason if final else None,
                      "prompt_token_ids": req.prompt_ids if want_ids and first else None,
                      "token_ids": [s.token_id for s in steps] if want_ids else None}
            chunk = dict(head, choices=[choice])
            if final:
                done[i] = True
                if not usage_on:
                    chunk["system_fingerprint"] = fp
            yield _sse(chunk)
    if usage_on:
        p, c = len(req.prompt_ids), sum(len(x) for x in ids)
        yield _sse(dict(head, choices=[], usage={"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c},
                        system_fingerprint=fp))
    yield b"data: [DONE]\n\n"


class VLLM(Dialect):
    name = "vllm"
    render = VLLM_RENDER
    tool_start = parsers.TOOL_START
    tool_end = parsers.TOOL_END
    checks_model_name = True
    streams_raw_arguments = True
    prompt_logprobs = True
    json_content_type = "application/json"
    fingerprint: str | None = None

    def split_reasoning(self, text, thinking):
        return parsers.split_reasoning_vllm(text, thinking)

    def split_tools(self, rest, tool_names, partial):
        return parsers.split_tools_vllm(rest, partial)

    def tool_call_id(self) -> str:
        return f"chatcmpl-tool-{random_uuid()}"

    def chat_id(self) -> str:
        return f"chatcmpl-{random_uuid()}"

    def completion_id(self) -> str:
        return f"cmpl-{random_uuid()}"

    def model_name(self, body: dict, served_name: str) -> str:
        return served_name

    def error_body(self, message: str, status: int, err_type: str | None) -> dict:
        t = err_type or {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
        return error_body(message, t, status)

    def configured(self, options) -> VLLM:
        d = VLLM()
        d.fingerprint = f"vllm-{VLLM_VERSION}-{_config_hash(getattr(options, 'model', ''))}"
        return d

    def dumps(self, obj) -> bytes:
        return dumps(obj)

    model_param = "model"

    def model_hint(self, served_names):
        return f" Valid aliases: {', '.join(served_names)}."

    def param_error(self, message, param, value, with_value):
        suffix = f"parameter={param}, value={value}" if with_value else f"parameter={param}"
        return f"{message} ({suffix})", param

    def check_chat(self, body: dict) -> None:
        if "messages" not in body:  # pydantic's own answer (a 400 of type "Bad Request")
            e = RequestError("1 validation error:\n  {'type': 'missing', 'loc': 'body.messages', 'msg': 'Field "
                               f"required', 'input': '<dict of {len(body)} items>'}}", 400, "Bad Request")
            e.param = "body.messages"
            raise e

    def check_sampling(self, body: dict, n: int) -> None:
        t = body.get("temperature")
        if n > 1 and isinstance(t, (int, float)) and t < 1e-5:
            raise RequestError(f"n must be 1 when using greedy sampling, got {n}.")

    def chat_answer(self, server, reqs, results, started, prompt_logprobs=None):
        return chat_full(server, reqs, results, prompt_logprobs)

    def chat_stream(self, server, reqs, queues, headers):
        return chat_stream(server, reqs, queues)

    def completion_answer(self, server, reqs, results, prompt_logprobs=None):
        return completion_full(server, reqs, results, prompt_logprobs)

    def completion_stream_n(self, server, reqs, queues, prompt_logprobs=None):
        return completion_stream(server, reqs, queues, prompt_logprobs)

    def model_card(self, server, name, created):
        perm = {"id": f"modelperm-{random_uuid()}", "object": "model_permission", "created": created,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
                "group": None, "is_blocking": False}
        return {"id": name, "object": "model", "created": created, "owned_by": "vllm",
                "root": str(server.model.model_dir), "parent": None, "max_model_len": server.model.max_len,
                "permission": [perm]}

    def http_error_body(self, status, reason):
        return {"detail": reason}

    def extra_routes(self, server, router):
        async def version(request):
            return server.json({"version": VLLM_VERSION})
        router.add_get("/version", version)

    def tokenize_extra(self, out, body, tokenizer):
        out["token_strs"] = tokenizer.convert_ids_to_tokens(out["tokens"]) if body.get("return_token_strs") else None


def _config_hash(model_dir) -> str:
    """Eight hex digits standing for vLLM's `vllm_config.compute_hash()[:8]` (per model and version)."""

    try:
        cfg = (Path(model_dir) / "config.json").read_bytes()
    except OSError:
        cfg = str(model_dir).encode()
    return hashlib.sha256(VLLM_VERSION.encode() + cfg).hexdigest()[:8]
