"""A chat or completions request as one generation, and what the generation produced.

A request body becomes a `GenerationRequest` (prompt ids, the engine Job, parser settings, the ids
and names its answer reports); the engine produces token Events; `collect_result` folds them into a
`GenerationResult` for non-streaming answers, and the dialect modules turn a GenerationResult (or
the live Events) into each server's exact JSON. Nothing here depends on which server is imitated
beyond what the Dialect object says.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from polar_contracts.chat.render import RequestError, render_chat, thinking_enabled
from polar_serve.dialect_base import Dialect

from .engine import Event, Job
from .model import TokenStep
from .params import sampling_params, stop_list
from .parsers import Parsed, StreamParser, parse_output
from .script import choose_reply


@dataclass
class GenerationRequest:
    """One generation a request asks for, with everything its answer needs to report."""
    body: dict
    dialect: Dialect
    model_name: str            # the name the response reports
    request_id: str
    created: int
    prompt_ids: list[int]
    prompt_text: str
    job: Job
    thinking: bool = True
    tools_active: bool = False
    tool_names: set[str] | None = None
    script_source: str | None = None


@dataclass
class GenerationResult:
    """The produced tokens and text, and why the generation ended."""
    steps: list[TokenStep] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "stop"
    stop_reason: int | str | None = None

    @property
    def ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    def add(self, ev: Event) -> None:
        """Fold in a token or done Event (a done Event may carry the last token)."""
        if ev.step is not None:
            self.steps.append(ev.step)
            self.text += ev.text
        if ev.kind == "done":
            self.finish_reason, self.stop_reason = ev.finish_reason, ev.stop_reason


def _tools_active(body: dict) -> bool:
    tools = body.get("tools")
    if not tools:
        return False
    tc = body.get("tool_choice", "auto")
    return tc != "none"


def chat_request(model, body: dict, dialect: Dialect, served_name: str, script: dict | None) -> GenerationRequest:
    """A /v1/chat/completions body as a generation (rendered prompt, sampling, scripted reply)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    input_ids = body.get("input_ids") if dialect.chat_input_ids else None
    if input_ids is not None:
        if not isinstance(input_ids, list) or not all(isinstance(x, int) for x in input_ids):
            raise RequestError("'input_ids' must be a list of integers")
        prompt_text, prompt_ids = model.tokenizer.decode(input_ids), list(input_ids)
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
        if reply.token_ids is not None:
            forced = list(reply.token_ids)
        else:
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
    return GenerationRequest(body, dialect, dialect.model_name(body, served_name), dialect.chat_id(),
                             int(time.time()), prompt_ids, prompt_text, job, thinking, _tools_active(body), names,
                             source)


def completion_request(model, body: dict, dialect: Dialect, served_name: str) -> GenerationRequest:
    """A /v1/completions body as a generation (one prompt: text or token ids)."""
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
    return GenerationRequest(body, dialect, dialect.model_name(body, served_name), dialect.completion_id(),
                             int(time.time()), ids, text, job, thinking=False)


async def collect_result(queue) -> GenerationResult:
    """Await a job's Events; the GenerationResult once it is done (its error raised if it failed)."""
    res = GenerationResult()
    while True:
        ev: Event = await queue.get()
        if ev.kind == "error":
            raise ev.error
        res.add(ev)
        if ev.kind == "done":
            return res


def parse_result(req: GenerationRequest, res: GenerationResult) -> Parsed:
    return parse_output(res.text, req.dialect, req.thinking, req.tools_active, req.tool_names)


def new_stream_parser(req: GenerationRequest) -> StreamParser:
    return StreamParser(req.dialect, req.thinking, req.tools_active, req.tool_names)


def logprob_token(tokenizer, tid: int, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else tokenizer.decode([tid])


def chat_logprob_entries(tokenizer, steps: list[TokenStep], as_ids: bool, entry) -> list[dict]:
    """`logprobs.content[]` entries; `entry(token, logprob, utf8_bytes)` is the dialect's layout of one."""
    out = []
    for st in steps:
        tok = logprob_token(tokenizer, st.token_id, as_ids)
        tops = []
        for tid, lp in st.top:
            t = logprob_token(tokenizer, tid, as_ids)
            tops.append(entry(t, lp, _utf8(t)))
        e = entry(tok, st.logprob, _utf8(tok))
        e["top_logprobs"] = tops
        out.append(e)
    return out


def _utf8(tok: str) -> list[int]:
    return list(tok.encode("utf-8", errors="replace"))


def legacy_logprobs(tokenizer, steps: list[TokenStep], as_ids: bool, offset0: int = 0) -> dict:
    """The /v1/completions `logprobs` object (OpenAI's legacy layout, the same in both servers)."""
    toks, lps, tops, offs = [], [], [], []
    off = offset0
    for st in steps:
        t = logprob_token(tokenizer, st.token_id, as_ids)
        toks.append(t)
        lps.append(st.logprob)
        tops.append({logprob_token(tokenizer, i, as_ids): lp for i, lp in st.top} if st.top else None)
        offs.append(off)
        off += len(tokenizer.decode([st.token_id]))
    return {"text_offset": offs, "token_logprobs": lps, "tokens": toks, "top_logprobs": tops}
