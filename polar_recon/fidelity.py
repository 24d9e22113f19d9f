"""The two invariants of a built row, checked (sans-IO, numpy only).

1. Context fidelity: for every trainable completion in a row, the tokens before it equal the
   prompt ids the server was served for that call, except spans of a known re-render class
   (rerender.py); the row counts those tokens (`realign_tokens`) and names the classes.
2. Accounting: every sampled completion (each choice of each call) of an episode is trained in
   exactly one row, or listed as excluded with a reason.

`context_alignment` is the one rule both the builder (strategies.py, which splits a chain where it
fails) and the checkers use. `check_sequences` is what the tests and `build --check` run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from polar_contracts.log.arrays import Call, Episode

from .link import Alignment, align
from .tokens import TurnMarkers

# why a sampled completion is not trained (manifest `excluded_calls`, report); a stable set of keys
EXCLUDE_REASONS = {
    "auxiliary": "flagged auxiliary by the capture (a title/summary call, not the agent's trajectory)",
    "error": "the call failed (no complete sample)",
    "no token ids": "the server returned no ids for the call",
    "no logprobs": "the server returned no logprobs for the call",
    "rejected retry": "a retried sample no later call extends (build --exclude-rejected-retries)",
    "longer than max_len": "the call alone (its prompt and completion) exceeds --max-len",
    "empty completion": "the row has no trainable token (the model sampled nothing)",
}


def reason_of(why: str) -> str:
    """The EXCLUDE_REASONS key of Call.why_unusable / a link note."""
    return "error" if why.startswith("error") else why


def context_alignment(context: np.ndarray, prompt: np.ndarray, m: TurnMarkers) -> Alignment | None:
    """How a row's `context` (the tokens before a completion) matches the served `prompt`: an
    alignment that consumes both completely with only known re-render spans, else None."""
    if len(context) == len(prompt) and np.array_equal(context, prompt):
        return Alignment(len(prompt), len(prompt), 0, 0, len(prompt))
    a = align(context, prompt, m)
    if a is None or a.keep_from != len(prompt):
        return None
    return a


@dataclass
class RowFidelity:
    realign_tokens: int = 0
    classes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def span_tokens(spans, n: int) -> int:
    """Row positions covered by re-rendered spans (a pure insertion on the served side counts the
    one row token at its place): how many context tokens differ from what was served."""
    hit = np.zeros(n + 1, dtype=bool)
    for p0, p1, _, _, _ in spans:
        hit[p0:max(p1, p0 + 1)] = True
    return int(hit[:n].sum())


def check_row(ids: np.ndarray, loss_mask: np.ndarray, logprobs: np.ndarray, starts: list[int],
              calls: list[Call], m: TurnMarkers) -> RowFidelity:
    """Verify one row: each call's completion sits at its start, trainable, with its own ids and
    logprobs, and the tokens before it align with the call's served prompt (known classes only)."""
    out = RowFidelity()
    spans = []
    for s, call in zip(starts, calls):
        comp = call.completion
        e = s + len(comp)
        if e > len(ids) or not np.array_equal(ids[s:e], comp):
            out.problems.append(f"call {call.call_index}: completion ids not at row position {s}")
            continue
        if len(comp) and (not loss_mask[s:e].all() or not np.allclose(logprobs[s:e], call.logprobs)):
            out.problems.append(f"call {call.call_index}: completion not trainable with its own logprobs")
        a = context_alignment(ids[:s], call.prompt, m)
        if a is None:
            out.problems.append(f"call {call.call_index}: the row's context differs from the served prompt "
                                "beyond known re-renders")
            continue
        spans.extend(a.spans)
    trained = np.zeros(len(ids), dtype=bool)
    for s, call in zip(starts, calls):
        trained[s:s + len(call.completion)] = True
    if (loss_mask.astype(bool) & ~trained).any():
        out.problems.append("mask 1 on tokens that are no call's completion")
    out.realign_tokens = span_tokens(spans, len(ids))
    out.classes = sorted(frozenset().union(*(sp[4] for sp in spans))) if spans else []
    return out


def check_sequences(ep: Episode, seqs, excluded: list[tuple[int, str]], m: TurnMarkers) -> list[str]:
    """Both invariants over one episode's built sequences (strategies.Sequence, with `call_rows`
    and `starts`) and its excluded calls [(call row, reason)]. Returns the problems (empty: ok)."""
    problems: list[str] = []
    by_row = {c.row: c for c in ep.calls}
    seen: dict[int, str] = {}
    for s in seqs:
        calls = [by_row[r] for r in s.call_rows]
        f = check_row(s.input_ids, s.loss_mask, s.logprobs, s.starts, calls, m)
        problems += [f"segment {s.segment}: {p}" for p in f.problems]
        if f.realign_tokens != s.realign_tokens or f.classes != sorted(s.realign_classes):
            problems.append(f"segment {s.segment}: realign_tokens/classes {s.realign_tokens}/{s.realign_classes} "
                            f"but the check finds {f.realign_tokens}/{f.classes}")
        for r in s.call_rows:
            if r in seen:
                problems.append(f"call row {r} trained in segment {s.segment} and {seen[r]}")
            seen[r] = f"segment {s.segment}"
    for r, reason in excluded:
        if r in seen:
            problems.append(f"call row {r} both {seen[r]} and excluded ({reason})")
        if reason not in EXCLUDE_REASONS:
            problems.append(f"call row {r} excluded for an unknown reason {reason!r}")
        seen[r] = f"excluded ({reason})"
    for c in ep.calls:
        if c.row not in seen:
            problems.append(f"call {c.call_index} choice {c.info.get('choice') or 0} (row {c.row}) is neither "
                            "trained nor excluded")
    return problems
