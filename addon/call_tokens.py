"""The token record of one model call (sans-IO): token ids and logprobs per choice, accumulated
as compact arrays (never per-token Python objects), and the rows they become.

``CallTokens`` is what chat.py / completions.py ``extract`` fill from the server's answers;
call.py's ``CallState`` (the call's state machine) holds one from the response headers on.

Ids arrive as JSON lists; ``array('i').extend`` stores them at 4 bytes a token, and the accumulator
is dropped when the flow ends (a finished flow's buffers must not wait for the cyclic GC).
"""
from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from addon.server_dialects import Plan

# Token ids are int32 (the log's type): null, a float, a bool or a value past int32 in an id list
# is a malformed answer, recorded as the row's error (never an exception out of a hook).
BAD_IDS = "not all int32 (null, float or out of range)"


def int32_array(ids: list) -> array | None:
    """``array('i', ids)``, or None when an element is not an int32."""
    try:
        out = array("i", ids)
    except (TypeError, OverflowError):
        return None
    return out


class ChoiceTokens:
    """One choice's ids, logprobs, prompt (when per choice) and finish reason, as they arrive."""

    __slots__ = ("ids", "lps", "lp_count_bad", "finish", "prompt", "seen_ids", "seen_lps", "bad")

    def __init__(self) -> None:
        self.ids = array("i")
        self.lps = array("f")
        self.lp_count_bad = False
        self.finish: str | None = None
        self.prompt: array | None = None  # per-choice prompt (SGLang / completions)
        self.seen_ids = False
        self.seen_lps = False
        self.bad: str | None = None  # what was malformed in this choice's ids (the row's error)

    def add_ids(self, ids: object) -> None:
        if isinstance(ids, list):
            try:
                self.ids.extend(ids)  # (array.extend checks every element: all or nothing)
            except (TypeError, OverflowError):
                self.bad = f"completion token ids {BAD_IDS}"
            self.seen_ids = True

    def set_ids(self, ids: object) -> None:
        if isinstance(ids, list):
            a = int32_array(ids)
            if a is None:
                self.bad = f"completion token ids {BAD_IDS}"
            else:
                self.ids = a
            self.seen_ids = True

    def set_prompt(self, ids: object) -> None:
        if isinstance(ids, list):
            a = int32_array(ids)
            if a is None:
                self.bad = f"prompt token ids {BAD_IDS}"
            self.prompt = a
        elif isinstance(ids, array):
            self.prompt = ids

    def add_lp_entries(self, content: list) -> None:
        """Chat ``logprobs.content`` entries: each entry's ``logprob`` (None or a non-dict entry
        counts as missing, -9999), appended without building a values list per stream chunk."""
        lps = self.lps
        try:
            for e in content:
                v = e.get("logprob") if isinstance(e, dict) else None
                lps.append(-9999.0 if v is None else v)
            self.seen_lps = True
        except TypeError:
            self.lp_count_bad = True

    def add_lps(self, values: list) -> None:
        try:
            self.lps.extend(-9999.0 if v is None else v for v in values)
            self.seen_lps = True
        except TypeError:
            self.lp_count_bad = True


@dataclass
class CallTokens:
    """Every choice of one call (``choice(i)``), the shared prompt, and the rows they become."""

    plan: Plan
    prompt: array | None = None  # shared prompt (vLLM chat, SGLang sglext)
    choices: dict[int, ChoiceTokens] = field(default_factory=dict)
    weight_version: str | None = None
    notes: list[str] = field(default_factory=list)
    # what makes every row of the call doubtful (an event that could not be parsed, a chunk that
    # could not be read): the rows' error, their ids not trusted
    errors: list[str] = field(default_factory=list)
    bad_prompt: str | None = None

    def choice(self, index: object) -> ChoiceTokens:
        i = index if isinstance(index, int) else 0
        acc = self.choices.get(i)
        if acc is None:
            acc = self.choices[i] = ChoiceTokens()
        return acc

    def set_prompt(self, ids: object) -> None:
        if isinstance(ids, list):
            a = int32_array(ids)
            if a is None:
                self.bad_prompt = f"prompt token ids {BAD_IDS}"
            self.prompt = a
        elif isinstance(ids, array):  # already parsed by idlists.PromptCache (never mutated)
            self.prompt = ids

    def rows(self) -> list[dict[str, Any]]:
        """One dict per choice: prompt_ids, completion_ids, completion_logprobs, finish_reason,
        error (explicit text when ids are missing: never an empty list standing for 'none')."""
        indices = sorted(set(range(self.plan.n)) | set(self.choices))
        out = []
        for i in indices:
            acc = self.choices.get(i) or ChoiceTokens()
            prompt = acc.prompt if acc.prompt is not None else self.prompt
            errors = list(self.errors)
            for bad in (self.bad_prompt if acc.prompt is None else None, acc.bad):
                if bad:
                    errors.append(f"malformed answer: {bad}")
            if prompt is None and not errors:
                errors.append("server returned no prompt token ids")
            if not acc.seen_ids:
                errors.append("server returned no completion token ids")
            comp = np.frombuffer(acc.ids, dtype=np.int32) if acc.seen_ids else None
            echo = self.plan.echo and prompt is not None and comp is not None
            if echo and self.plan.dialect != "vllm":  # (vLLM 0.32: token_ids is the completion only)
                head = np.frombuffer(prompt, dtype=np.int32)
                if len(comp) >= len(head) and np.array_equal(comp[:len(head)], head):
                    comp = comp[len(head):]  # the echoed prompt ids in front of token_ids
                else:
                    errors.append("echo: the server's token_ids do not start with the prompt ids")
            lps = None
            if acc.seen_lps and not acc.lp_count_bad and comp is not None:
                lps = np.frombuffer(acc.lps, dtype=np.float32)
                if echo and len(lps) == len(prompt) + len(comp):
                    lps = lps[len(prompt):]  # echo: the logprobs cover the prompt too
                if len(lps) != len(comp):  # never a row whose logprobs do not belong to its ids
                    errors.append(f"{len(lps)} logprobs for {len(comp)} completion ids")
                    lps = None
            elif comp is not None and self.plan.echo and self.plan.api == "completions":
                # (server_dialects.plan_echo: the proxy does not ask vLLM for logprobs with echo, which
                # would make it compute the prompt's too; a row without logprobs cannot train, so it
                # says so as an error, never as a success)
                errors.append("no logprobs: completions with echo: the proxy does not ask the server for "
                              "logprobs on an echo request (vLLM would compute and return the prompt's logprobs "
                              "as well); send logprobs (e.g. \"logprobs\": 0) with the echo request, or no echo, "
                              "to record this call for training")
            elif comp is not None:
                self.notes.append(f"choice {i}: server returned no logprobs")
            out.append(
                dict(
                    choice=i,
                    prompt_ids=None if prompt is None or errors else np.frombuffer(prompt, dtype=np.int32),
                    completion_ids=None if errors else comp,
                    completion_logprobs=None if errors else lps,
                    finish_reason=acc.finish,
                    missing="; ".join(errors) or None,
                )
            )
        return out

    def free(self) -> None:
        self.choices = {}
        self.prompt = None


ExtractFn = Callable[[CallTokens, dict], None]
