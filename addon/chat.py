"""POST /v1/chat/completions (sans-IO): where the ids and logprobs sit in a response or stream
chunk of each dialect, and how a stream is reassembled into the one response the harness got."""
from __future__ import annotations

from array import array
from typing import Any

from . import assemble
from .call_tokens import CallTokens


def extract(cap: CallTokens, obj: dict) -> None:
    """Take ids/logprobs out of one chat response object or stream chunk (before stripping).
    Runs once per stream chunk: plain ``get`` + ``isinstance`` only, no helper calls per key."""
    get = obj.get
    prompt = get("prompt_token_ids")
    if prompt is not None and isinstance(prompt, (list, array)):  # vLLM, top level
        cap.set_prompt(prompt)
    ext = get("sglext")
    if ext is not None and isinstance(ext, dict):  # SGLang streaming: one final chunk with all ids
        cap.set_prompt(ext.get("input_ids"))
        outs = ext.get("output_ids")
        if isinstance(outs, list):
            if outs and not isinstance(outs[0], list):
                outs = [outs]
            for i, ids in enumerate(outs):
                cap.choice(i).set_ids(ids)
    meta = get("meta_info")
    if isinstance(meta, dict) and meta.get("weight_version") is not None:
        cap.weight_version = str(meta["weight_version"])
    choices = get("choices")
    if not isinstance(choices, list):
        return
    for ch in choices:
        if not isinstance(ch, dict):
            continue
        acc = cap.choice(ch.get("index", 0))
        cget = ch.get
        cprompt = cget("prompt_token_ids")
        if cprompt is not None and isinstance(cprompt, (list, array)):  # SGLang non-streaming
            acc.prompt = None
            cap.set_prompt(cprompt)
        if "token_ids" in ch:  # vLLM (stream deltas / full list); newer SGLang non-streaming
            acc.add_ids(ch["token_ids"])
        if "response_token_ids" in ch:  # SGLang non-streaming (docs/reference.md, "Wire formats")
            acc.set_ids(ch["response_token_ids"])
        cmeta = cget("meta_info")  # SGLang non-streaming with return_meta_info
        if cmeta is not None and isinstance(cmeta, dict) and cmeta.get("weight_version") is not None:
            cap.weight_version = str(cmeta["weight_version"])
        lp = cget("logprobs")
        if lp is not None and isinstance(lp, dict):
            content = lp.get("content")
            if isinstance(content, list):
                acc.add_lp_entries(content)
        finish = cget("finish_reason")
        if finish is not None:
            acc.finish = finish


class Assembler(assemble.Assembler):
    """Rebuilds a chat.completion object from the (harness-visible) stream chunks."""

    object_name = "chat.completion"

    def new_choice(self, index: int) -> dict[str, Any]:
        return {"index": index, "message": {}, "finish_reason": None, "_parts": {}}

    def add_choice(self, c: dict[str, Any], ch: dict) -> None:
        delta = ch.get("delta") or {}
        if isinstance(delta, dict):
            parts = c["_parts"]
            for k, v in delta.items():
                if k == "tool_calls" and isinstance(v, list):
                    self._tool_calls(c, v)
                elif isinstance(v, str) and k != "role":
                    got = parts.get(k)
                    if got is None:
                        parts[k] = [v]
                    else:
                        got.append(v)
                elif v is not None:
                    c["message"][k] = v
        lp = ch.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            c.setdefault("logprobs", {"content": []})["content"].extend(lp["content"])

    @staticmethod
    def _tool_calls(c: dict, deltas: list) -> None:
        calls = c["message"].setdefault("tool_calls", [])
        for d in deltas:
            if not isinstance(d, dict):
                continue
            i = d.get("index", len(calls))
            while len(calls) <= i:
                calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
            tc = calls[i]
            if d.get("id"):
                tc["id"] = d["id"]
            if d.get("type"):
                tc["type"] = d["type"]
            fn = d.get("function") or {}
            if fn.get("name"):
                tc["function"]["name"] += fn["name"]
            if fn.get("arguments"):
                tc["function"]["arguments"] += fn["arguments"]

    def end_choice(self, c: dict[str, Any]) -> dict[str, Any]:
        msg = {"role": "assistant", **c["message"]}
        for k, parts in c.pop("_parts").items():
            msg[k] = "".join(parts)
        c["message"] = msg
        return c
