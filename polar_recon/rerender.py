"""The known ways a served prompt re-renders an assistant turn the model sampled (sans-IO).

A harness sends its earlier assistant turns back as messages; the server renders them with the
chat template, so the prompt of a later call may hold a turn in other tokens than the ones the
model sampled. Training keeps the SAMPLED tokens in the row (they carry the logprobs), so the
row's context then differs from what the model was served. That is acceptable only for a named
re-render class, recognised by what it is; anything else (an edited message, rewritten
tool-call arguments) means the harness changed history, and the later call must be a FORK.

`classify(old, new)` compares one turn as sampled (`old`: the text after ``<|im_start|>assistant``
up to and including ``<|im_end|>`` if the model emitted it) with the same turn as served (`new`)
and returns the set of classes that explain every difference, or None. The text is parsed the
way the Qwen3 template (data/tokenizers/qwen3) and vLLM's qwen3 reasoning + hermes tool parsers
split a turn: ``<think>`` block, content, ``<tool_call>`` blocks.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# class -> what it is (docs and reports use these names; they are a contract of the shard column
# `realign_classes`)
CLASSES: dict[str, str] = {
    "thinking-dropped": "the template dropped the turn's non-empty <think> block (Qwen3 drops the thinking of "
                        "turns before the last user query; harnesses that do not resend reasoning_content)",
    "empty-thinking-dropped": "an empty/whitespace-only <think></think> block the model sampled is not re-rendered",
    "think-newlines": "the template re-wraps the reasoning as <think>\\n...\\n</think> (reasoning.strip('\\n'))",
    "leading-newlines": "the content's leading newlines differ (the template's content.lstrip('\\n') after "
                        "</think>, or the raw content rendered once the think block is dropped)",
    "whitespace-content": "whitespace-only content echoed back and re-rendered with other whitespace "
                          "(the template adds '\\n' before a tool call when content is truthy)",
    "null-content": "content null on one side, whitespace-only (vLLM's \"\\n\\n\") on the other",
    "tool-call-newline": "the newline the template puts before each <tool_call> (after content, between calls) "
                         "that the model did not sample, or sampled and the parser dropped",
    "tool-arguments-reserialized": "tool-call JSON re-serialized with the same value (spacing, key order, escapes)",
    "bpe-merge": "the same text split into other tokens: BPE merges the header's '\\n' with the re-rendered "
                 "turn's leading newlines (<|im_start|>assistant\\n + \\n\\n -> assistant, \\n\\n\\n)",
    "closed-by-template": "the sampled turn stopped without <|im_end|> (length cut); the template closed it",
}

END = "<|im_end|>"


@dataclass
class Turn:
    think: str | None
    content: str
    calls: list[tuple[str, object]]  # (raw text between the tags, parsed JSON or a sentinel)
    seps: list[str]  # text between consecutive </tool_call> and <tool_call>, and after the last
    closed: bool


_BAD = object()  # a tool call whose JSON does not parse: compared as raw text only


def parse(text: str) -> Turn | None:
    """One assistant turn body (after ``<|im_start|>assistant``), None if it is not one."""
    if not text.startswith("\n"):
        return None  # the header's newline: always there
    body = text[1:]
    closed = body.endswith(END)
    if closed:
        body = body[: -len(END)]
    if END in body:
        return None
    think = None
    if body.startswith("<think>"):
        k = body.find("</think>")
        if k < 0:
            return Turn(body[len("<think>"):], "", [], [], closed)
        think, body = body[len("<think>"):k], body[k + len("</think>"):]
        if body.startswith("\n\n"):  # the block's own separator (the template writes '\n</think>\n\n')
            body = body[2:]
    k = body.find("<tool_call>")
    content, rest = (body, "") if k < 0 else (body[:k], body[k:])
    calls: list[tuple[str, object]] = []
    seps: list[str] = []
    while rest:
        if not rest.startswith("<tool_call>"):
            return None
        e = rest.find("</tool_call>")
        if e < 0:  # unterminated call (length cut): raw text only
            calls.append((rest[len("<tool_call>"):], _BAD))
            break
        raw = rest[len("<tool_call>"):e]
        try:
            val = json.loads(raw)
        except ValueError:
            val = _BAD
        calls.append((raw, val))
        rest = rest[e + len("</tool_call>"):]
        n = rest.find("<tool_call>")
        sep, rest = (rest, "") if n < 0 else (rest[:n], rest[n:])
        seps.append(sep)
    return Turn(think, content, calls, seps, closed)


def classify(old: str, new: str) -> frozenset[str] | None:
    """The classes that explain every difference between the sampled turn `old` and the served
    turn `new` (texts after ``<|im_start|>assistant``), or None when one is not a known
    re-render (then the harness changed the turn: a FORK). Equal texts give the empty set."""
    if old == new:
        return frozenset()
    o, n = parse(old), parse(new)
    if o is None or n is None:
        return None
    cls: set[str] = set()
    if not o.closed:
        if not n.closed:
            return None
        cls.add("closed-by-template")
    elif not n.closed:
        return None
    # the think block
    if o.think is not None and n.think is None:
        cls.add("thinking-dropped" if o.think.strip() else "empty-thinking-dropped")
    elif o.think is None and n.think is not None:
        return None  # the served prompt invents reasoning the model never sampled
    elif o.think is not None and n.think is not None and o.think != n.think:
        if o.think.strip("\n") != n.think.strip("\n"):
            return None
        cls.add("think-newlines")
    # content (before the first tool call)
    oc, nc = o.content, n.content
    if oc != nc:
        if not oc.strip() and not nc.strip():
            cls.add("null-content" if (oc == "") != (nc == "") else "whitespace-content")
        else:
            ol, nl = oc.lstrip("\n"), nc.lstrip("\n")
            if len(oc) - len(ol) != len(nc) - len(nl):
                cls.add("leading-newlines")
            oc, nc = ol, nl
            if oc != nc:
                if not (o.calls and n.calls and oc.rstrip("\n") == nc.rstrip("\n")):
                    return None
                cls.add("tool-call-newline")
    # tool calls: same calls, same values
    if len(o.calls) != len(n.calls):
        return None
    for (oraw, oval), (nraw, nval) in zip(o.calls, n.calls):
        if oraw == nraw:
            continue
        if oval is _BAD or nval is _BAD or oval != nval:
            return None
        cls.add("tool-arguments-reserialized")
    for a, b in zip(o.seps, n.seps):
        if a != b:
            if a.strip() or b.strip():
                return None
            cls.add("tool-call-newline")
    if not cls:  # same parse, different text: cannot happen unless the parse is lossy
        return None
    return frozenset(cls)
