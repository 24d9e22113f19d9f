"""Rebuilding one response object from its stream chunks, for the log's `response` column.

The walk over chunks (head fields, usage, choices by index, finish_reason) is the same for chat and
completions; each API only says how a choice starts, takes a chunk's choice, and ends.
"""
from __future__ import annotations

from typing import Any


class Assembler:
    object_name = ""

    def __init__(self) -> None:
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None

    def add(self, chunk: dict) -> None:
        if not self.head:
            self.head = {k: chunk.get(k) for k in ("id", "created", "model") if k in chunk}
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            if not isinstance(ch, dict):
                continue
            i = ch.get("index", 0)
            if not isinstance(i, int):  # (a null or odd index: choice 0, as call_tokens.py reads it)
                i = 0
            c = self.choices.get(i)
            if c is None:  # (not setdefault: that would build the dict on every chunk)
                c = self.choices[i] = self.new_choice(i)
            self.add_choice(c, ch)
            if ch.get("finish_reason") is not None:
                c["finish_reason"] = ch["finish_reason"]

    def result(self) -> dict:
        choices = [self.end_choice(self.choices[i]) for i in sorted(self.choices)]
        out = {**self.head, "object": self.object_name, "choices": choices}
        if self.usage is not None:
            out["usage"] = self.usage
        return out

    def new_choice(self, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def add_choice(self, c: dict[str, Any], ch: dict) -> None:
        raise NotImplementedError

    def end_choice(self, c: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError
