"""The server polar-serve answers as: one `Dialect` object per server, holding every rule in which
the two differ (prompt rendering, output parsing, ids, wire layouts, extra routes).

`dialect_vllm.VLLM` and `dialect_sglang.SGLang` implement it; `dialects.DIALECTS` names them. The
rest of polar-serve asks the dialect object and never compares a dialect name.
"""
from __future__ import annotations

import json
import uuid

from polar_contracts.chat.render import RenderRules


class Dialect:
    name: str                   # what `--dialect` takes
    render: RenderRules         # how the chat request is prepared for the template (polar_contracts.chat.render)
    # output parsing (parsers.py): reasoning and tool-call splitting, streamed tool-call rules
    tool_start: str                             # the tool-call block delimiters the tool parser looks for
    tool_end: str
    strips_text_before_tool_call: bool = False  # SGLang strips the text before a call
    skips_undeclared_tools: bool = False        # SGLang drops calls to tools the request did not declare
    lags_streamed_arguments: bool = False       # SGLang sends what two successive partial parses agree on
    streams_raw_arguments: bool = False         # vLLM streams the arguments' raw text token by token
    checks_model_name: bool = False             # vLLM answers 404 for a model it does not serve
    chat_input_ids: bool = False                # SGLang takes `input_ids` on a chat request (no template)
    prompt_logprobs: bool = False               # vLLM computes `prompt_logprobs` (non-streaming)
    json_content_type: str = "application/json; charset=utf-8"  # of JSON answers (vLLM: no charset)

    def dumps(self, obj) -> bytes:
        """A JSON answer's bytes (vLLM: pydantic's compact JSON)."""
        return json.dumps(obj, ensure_ascii=False).encode()

    model_param: str | None = None             # vLLM names "model" in the error of an unknown model

    def model_hint(self, served_names: list[str]) -> str:
        """What the unknown-model error adds after "The model `x` does not exist."."""
        return ""

    def param_error(self, message: str, param: str, value, with_value: bool) -> tuple[str, str | None]:
        """(message, param field) of an error about request field `param` (params.param_error)."""
        return message, None

    def check_sampling(self, body: dict, n: int) -> None:
        """Refuse sampling settings this server refuses (RequestError)."""

    def split_reasoning(self, text: str, thinking: bool) -> tuple[str | None, str]:
        """(reasoning, rest) of a model output."""
        raise NotImplementedError

    def split_tools(self, rest: str, tool_names: set[str] | None, partial: bool):
        """(content, tool calls, ok) of the output after the reasoning (parsers.split_tools_*)."""
        raise NotImplementedError

    def tool_call_id(self) -> str:
        raise NotImplementedError

    def chat_id(self) -> str:
        """The id of a chat completions answer."""
        raise NotImplementedError

    def completion_id(self) -> str:
        """The id of a completions answer."""
        raise NotImplementedError

    def model_name(self, body: dict, served_name: str) -> str:
        """The model name an answer reports."""
        raise NotImplementedError

    def configured(self, options) -> Dialect:
        """This dialect with the command-line `options` (argparse namespace) that concern it applied."""
        return self

    # wire format (the dialect modules); `server` is the app.Server answering
    def error_body(self, message: str, status: int, err_type: str | None) -> dict:
        raise NotImplementedError

    def check_chat(self, body: dict) -> None:
        """Refuse what this server refuses before rendering (RequestError)."""

    def chat_full(self, server, req, res, started: float) -> dict:
        """The non-streamed chat answer of GenerationRequest `req` with GenerationResult `res`."""
        raise NotImplementedError

    def chat_answer(self, server, reqs, results, started: float, prompt_logprobs=None) -> dict:
        """The non-streamed chat answer of n choices (GenerationRequests `reqs`, GenerationResults
        `results`); by default one chat_full per choice merged, usage summed."""
        outs = []
        for i, (req, res) in enumerate(zip(reqs, results, strict=True)):
            o = self.chat_full(server, req, res, started)
            o["choices"][0]["index"] = i
            outs.append(o)
        out = outs[0]
        if len(outs) > 1:
            out["choices"] = [o["choices"][0] for o in outs]
            u = out["usage"]
            u["completion_tokens"] = sum(o["usage"]["completion_tokens"] for o in outs)
            u["total_tokens"] = u["prompt_tokens"] + u["completion_tokens"]
            if "reasoning_tokens" in u:
                u["reasoning_tokens"] = sum(o["usage"]["reasoning_tokens"] for o in outs)
        return out

    def completion_answer(self, server, reqs, results, prompt_logprobs=None) -> dict:
        return self.completion_full(server, reqs[0], results[0])

    def completion_stream_n(self, server, reqs, queues, prompt_logprobs=None):
        return self.completion_stream(server, reqs[0], queues[0])

    def chat_stream(self, server, reqs, queues, headers):
        """The SSE byte chunks of a streamed chat answer (one request and Event queue per choice)."""
        raise NotImplementedError

    def completion_full(self, server, req, res) -> dict:
        raise NotImplementedError

    def completion_stream(self, server, req, queue):
        raise NotImplementedError

    def model_card(self, server, name: str, created: int) -> dict:
        raise NotImplementedError

    def tokenize_extra(self, out: dict, body: dict, tokenizer) -> None:
        """Fields this server adds to a /tokenize answer."""

    def http_error_body(self, status: int, reason: str) -> dict | None:
        """The JSON of a 404/405 for an unknown route or method (None: aiohttp's plain text)."""
        return None

    def extra_routes(self, server, router) -> None:
        """Routes only this server has."""


def hex_id() -> str:
    return uuid.uuid4().hex
