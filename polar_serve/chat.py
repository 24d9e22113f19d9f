"""The dialect-independent part of a chat / completions request: prompt, job, parsing, collection.

A request becomes a `Call` (prompt ids, sampling, parser settings, flags); the engine produces
token Events; `collect` folds them into a `Result` for non-streaming answers, and the dialect
modules turn a Result (or the live Events) into each server's exact JSON.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from .engine import Event, Job
from .dialect import Dialect
from .model import SamplingParams, TokenStep
from .parsers import Parsed, StreamParser, parse_output
from .params import sampling_params, stop_list
from polar_recon.chat_render import RequestError, render_chat, thinking_enabled
from .script import choose_reply


@dataclass
class Call:
    body: dict
    dialect: Dialect
    model_name: str            # the name the response reports
    request_id: str
    created: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    job: Job
    thinking: bool = True
    tools_active: bool = False
    tool_names: set[str] | None = None
    script_source: str | None = None


@dataclass
class Result:
    steps: list[TokenStep] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "stop"
    stop_reason: int | str | None = None

    @property
    def ids(self) -> list[int]:
        return [s.token_id for s in self.steps]


def _tools_active(body: dict) -> bool:
    tools = body.get("tools")
    if not tools:
        return False
    tc = body.get("tool_choice", "auto")
    return tc != "none"


def build_chat_call(model, body: dict, dialect: Dialect, served_name: str, script: dict | None) -> Call:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    sg_input_ids = body.get("input_ids") if dialect.chat_input_ids else None
    if sg_input_ids is not None:
        if not isinstance(sg_input_ids, list) or not all(isinstance(x, int) for x in sg_input_ids):
            raise RequestError("'input_ids' must be a list of integers")
        prompt_text, prompt_ids = model.tokenizer.decode(sg_input_ids), list(sg_input_ids)
    else:
        prompt_text, prompt_ids = render_chat(model.tokenizer, body, dialect.render)
    params = sampling_params(body, model.gen_defaults, model.max_len, len(prompt_ids), chat=True)
    thinking = thinking_enabled(body)
    job = Job(prompt_ids, params, stop=stop_list(body), include_stop_str=bool(body.get("include_stop_str_in_output")))
    source = None
    reply = choose_reply(script, body, thinking) if script is not None else None
    if reply is not None and reply.text is None:
        job.delay, source = reply.delay, reply.source
    elif reply is not None:
        forced = model.tokenizer.encode(reply.text, add_special_tokens=False) + [model.eos_ids[0]]
        if len(forced) > params.max_tokens:
            forced = forced[:params.max_tokens]
        # Teacher-forced logprobs: log-softmax after temperature only; top-k/top-p masks would
        # floor every scripted token the model would not have sampled at -9999.
        job.forced_ids = forced
        job.params = dataclasses.replace(params, top_k=-1, top_p=1.0, min_p=0.0)
        job.delay = reply.delay
        source = reply.source
    names = {t["function"]["name"] for t in body.get("tools") or []}
    tc = body.get("tool_choice")
    if isinstance(tc, dict):
        names = {(tc.get("function") or {}).get("name")}
    return Call(body, dialect, dialect.model_name(body, served_name), dialect.request_id("chat"),
                int(time.time()), prompt_ids, prompt_text, job.params, job, thinking,
                _tools_active(body), names, source)


def build_completion_call(model, body: dict, dialect: Dialect, served_name: str) -> Call:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' must not be empty")
        ids = model.tokenizer.encode(prompt, add_special_tokens=False)
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        ids = list(prompt)
        vocab = model.hf.config.vocab_size
        bad = [x for x in ids if x < 0 or x >= vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is out of vocabulary (size {vocab})")
        text = model.tokenizer.decode(ids)
    else:
        raise RequestError("'prompt' must be a string, a list of token ids, or a one-element list of either "
                           "(batched prompts are not supported by polar-serve)")
    params = sampling_params(body, model.gen_defaults, model.max_len, len(ids), chat=False)
    job = Job(ids, params, stop=stop_list(body), include_stop_str=bool(body.get("include_stop_str_in_output")))
    return Call(body, dialect, dialect.model_name(body, served_name), dialect.request_id("cmpl"),
                int(time.time()), ids, text, params, job, thinking=False)


async def collect(queue) -> Result:
    res = Result()
    while True:
        ev: Event = await queue.get()
        if ev.kind == "token":
            res.steps.append(ev.step)
            res.text += ev.text
        elif ev.kind == "done":
            if ev.step is not None:
                res.steps.append(ev.step)
                res.text += ev.text
            res.finish_reason, res.stop_reason = ev.finish_reason, ev.stop_reason
            return res
        else:
            raise ev.error


def parse_result(call: Call, res: Result) -> Parsed:
    return parse_output(res.text, call.dialect, call.thinking, call.tools_active, call.tool_names)


def new_stream_parser(call: Call) -> StreamParser:
    return StreamParser(call.dialect, call.thinking, call.tools_active, call.tool_names)


def logprob_token(tokenizer, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else tokenizer.decode([tid])


def chat_logprob_entries(tokenizer, steps: list[TokenStep], as_ids: bool, sglang: bool) -> list[dict]:
    """`logprobs.content[]` entries (vLLM key order token/logprob/bytes; SGLang token/bytes/logprob)."""
    out = []
    for st in steps:
        tok = logprob_token(tokenizer, st.token_id, as_ids)
        tops = []
        for tid, lp in st.top:
            t = logprob_token(tokenizer, tid, as_ids)
            tops.append(_lp(t, lp, sglang))
        e = _lp(tok, st.logprob, sglang)
        e["top_logprobs"] = tops
        out.append(e)
    return out


def _lp(tok: str, lp: float, sglang: bool) -> dict:
    b = list(tok.encode("utf-8", errors="replace"))
    return {"token": tok, "bytes": b, "logprob": lp} if sglang else {"token": tok, "logprob": lp, "bytes": b}


def reasoning_token_count(ids: list[int], tokenizer, through_end: bool) -> int:
    """SGLang counts reasoning tokens through `</think>`, vLLM between the tags."""
    end = tokenizer.convert_tokens_to_ids("</think>")
    if end in ids:
        i = ids.index(end)
        return i + 1 if through_end else max(i - (1 if ids and ids[0] == end - 1 else 0), 0)
    return 0
