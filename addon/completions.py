"""POST /v1/completions (sans-IO): ids sit on each choice in both dialects (``prompt_token_ids``
on the first chunk of a choice, ``token_ids`` deltas); logprobs use the legacy
``{tokens, token_logprobs, top_logprobs, text_offset}`` shape."""
from __future__ import annotations

from array import array
from typing import Any

from . import assemble
from .call_tokens import CallTokens


def extract(cap: CallTokens, obj: dict) -> None:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        acc = cap.choice(ch.get("index", 0))
        pids = ch.get("prompt_token_ids")
        if isinstance(pids, (list, array)):  # (an array: parsed by idlists.PromptCache)
            acc.set_prompt(pids)
        if "token_ids" in ch:
            acc.add_ids(ch["token_ids"])
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
            acc.add_lps(lp["token_logprobs"])
        if ch.get("finish_reason") is not None:
            acc.finish = ch["finish_reason"]


class Assembler(assemble.Assembler):
    """Rebuilds a text_completion object from the (harness-visible) stream chunks."""

    object_name = "text_completion"

    def new_choice(self, index: int) -> dict[str, Any]:
        return {"index": index, "text": [], "finish_reason": None}

    def add_choice(self, c: dict[str, Any], ch: dict) -> None:
        if isinstance(ch.get("text"), str):
            c["text"].append(ch["text"])
        lp = ch.get("logprobs")
        if isinstance(lp, dict):
            agg = c.setdefault("logprobs", {})
            for k, v in lp.items():
                if isinstance(v, list):
                    agg.setdefault(k, []).extend(v)

    def end_choice(self, c: dict[str, Any]) -> dict[str, Any]:
        return {**c, "text": "".join(c["text"])}
