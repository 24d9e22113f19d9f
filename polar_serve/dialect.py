"""The server polar-serve answers as: one `Dialect` object per server, holding every rule in which
the two differ (prompt rendering, output parsing, ids, wire layouts, extra routes).

`dialect_vllm.VLLM` and `dialect_sglang.SGLang` implement it; `dialects.DIALECTS` names them. The
rest of polar-serve asks the dialect object and never compares a dialect name.
"""
from __future__ import annotations

import uuid

from polar_recon.chat_render import RenderRules


class Dialect:
    name: str                   # what `--dialect` takes
    render: RenderRules         # how the chat request is prepared for the template (polar_recon.chat_render)
    # output parsing (parsers.py): reasoning and tool-call splitting, streamed tool-call rules
    tool_start: str                             # the tool-call block delimiters the tool parser looks for
    tool_end: str
    strips_text_before_tool_call: bool = False  # SGLang strips the text before a call
    skips_undeclared_tools: bool = False        # SGLang drops calls to tools the request did not declare
    lags_streamed_arguments: bool = False       # SGLang sends what two successive partial parses agree on
    checks_model_name: bool = False             # vLLM answers 404 for a model it does not serve
    chat_input_ids: bool = False                # SGLang takes `input_ids` on a chat request (no template)

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

    def extra_routes(self, server, router) -> None:
        """Routes only this server has."""


def hex_id() -> str:
    return uuid.uuid4().hex
