"""The three ways to turn one episode into training sequences.

- ``token`` (the default, the point of the project): link the calls (link.py), one sequence per
  segment, the sampled completion ids trainable with their behaviour logprobs, everything the
  model did not sample (prompts, tool results, re-rendered turns) context with mask 0.
- ``per-call``: every usable call its own sequence (prompt mask 0 + completion mask 1). Changes
  what sequence-level losses mean; offered for comparison.
- ``retokenize``: the baseline this project exists to remove: for each segment, render the final
  conversation (the last request's messages) as text with the chat template, append the last
  completion's text, and tokenize again. Assistant turns train; logprobs are attached by position
  inside each turn, as a text-based pipeline would.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polar_contracts.chat.render import RequestError, render_rules, render_text
from polar_contracts.log.arrays import Call, Episode
from polar_contracts.log.end_record import CONTROL_PLANE, ISOLATION, STATUS, TIMEOUT
from polar_contracts.sampling_fields import combine
from polar_contracts.translate import gemini_to_chat, messages_to_chat, responses_to_chat
from polar_contracts.weight_versions import is_marker

from .fidelity import context_alignment, reason_of, span_tokens
from .link import AUX, CLEAN, ERROR, FORK, REALIGN, RETRY, Alignment, Node, link_calls, segments
from .tokens import DEFAULT_TOKENIZER, TurnMarkers

STRATEGIES = ("token", "per-call", "retokenize")


class ReconError(Exception):
    """An episode that cannot be reconstructed; the message names the episode."""


@dataclass
class Sequence:
    episode_id: str
    segment: int
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8
    logprobs: np.ndarray  # float32
    n_calls: int
    n_realign: int
    weight_version: str | None
    model: str | None
    calls: list[int]  # call_index of each merged call
    # the sampling columns (sampling.COLUMNS) of the calls, merged by sampling.combine: a value
    # the calls disagree on is None, with the reason in sampling_unsupported
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    logprobs_mode: str | None = None
    sampling_unsupported: str | None = None
    sampling_source: str | None = None
    # context fidelity (shards.py documents the columns)
    realign_tokens: int | None = 0  # None: not checked (retokenize rebuilds the text)
    realign_classes: list[str] = field(default_factory=list)
    termination: str | None = None
    isolation: str | None = None  # the episode's, from its end metadata
    control_plane: str | None = None  # likewise: secured | open
    # not columns: each call's file row and the row position where its completion starts (the
    # fidelity checks, the accounting of every sampled completion)
    call_rows: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        ones = np.flatnonzero(self.loss_mask)
        return int(ones[0]) if len(ones) else len(self.loss_mask)


def chain_sampling(calls: list[Call]) -> dict:
    """The sampling columns of one sequence's calls (sampling.combine: calls that differ give
    null and a ``sampling_unsupported`` reason the trainer acts on, never a silently wrong value)."""
    return combine(c.info for c in calls)


def oldest_version(versions: list[str | None]) -> str | None:
    """The oldest weight version of a sequence's calls (in call order). A call that names no single
    version (null: unknown; a ``spans:`` or ``unknown:`` marker, polar_contracts/weight_versions.py)
    gives the sequence that value: its staleness cannot be bounded, so the trainer must not read
    the row as one version. Otherwise numeric order when all are numbers (polar-serve's reload
    counters), else the first call's (calls come in order, and versions only move forward)."""
    for v in versions:
        if v is None or is_marker(v):
            return v
    if not versions:
        return None
    try:
        return min(versions, key=float)
    except ValueError:
        return versions[0]


def _own_termination(call: Call) -> str:
    if call.info.get("error"):
        return "error"
    return "length" if call.info.get("finish_reason") == "length" else "stop"


def isolation(ep: Episode) -> str | None:
    """How the rollout confined the harness (end metadata "isolation"); None when it did not say."""
    value = (ep.metadata or {}).get(ISOLATION)
    return value if isinstance(value, str) else None


def control_plane(ep: Episode) -> str | None:
    """Whether the proxy's control plane was secured (end metadata "control_plane"); None when unsaid."""
    value = (ep.metadata or {}).get(CONTROL_PLANE)
    return value if isinstance(value, str) else None


def termination(ep: Episode, calls: list[Call]) -> str:
    """How a row ended (shards.TERMINATIONS), for the trainer's mask_truncated_completions, which
    masks every row of an episode that ended by length/timeout: the row's own last call when that
    one did not stop normally (``length``: cut at max_tokens; ``error``), else the EPISODE's end:
    ``timeout`` when the rollout ended it on a timeout (harness_recipes records end metadata
    ``status: "timeout"``), else how the episode's last sampled call ended."""
    own = _own_termination(calls[-1])
    if own != "stop":
        return own
    if ep.metadata.get(STATUS) == "timeout" or ep.metadata.get(TIMEOUT) is True:
        return "timeout"
    usable = [c for c in ep.calls if c.usable]
    return _own_termination(max(usable, key=lambda c: c.call_index)) if usable else own


def _pieces_to_sequence(ep: Episode, seg: int, calls: list[Call], pieces, n_realign: int) -> Sequence:
    ids = np.concatenate([p[0] for p in pieces]).astype(np.int32, copy=False)
    mask = np.concatenate([np.full(len(p[0]), p[1], dtype=np.int8) for p in pieces])
    lps = np.concatenate([p[2] if p[2] is not None else np.zeros(len(p[0]), np.float32) for p in pieces])
    starts, pos = [], 0
    for p in pieces:
        if p[1]:
            starts.append(pos)
        pos += len(p[0])
    return Sequence(
        ep.episode_id, seg, ids, mask, lps.astype(np.float32, copy=False), len(calls), n_realign,
        oldest_version([c.info.get("weight_version") for c in calls]), calls[0].info.get("model"),
        [c.call_index for c in calls], **chain_sampling(calls), termination=termination(ep, calls),
        isolation=isolation(ep), control_plane=control_plane(ep), call_rows=[c.row for c in calls], starts=starts,
    )


def trained_chains(ep: Episode, nodes: list[Node]) -> list[list[int]]:
    """The segments, checked: a call in two sequences would train its sampled tokens twice (the
    worst silent error this package can make), so it is an error for the episode, never a shard."""
    chains = segments(nodes)
    seen: dict[int, int] = {}
    for s, chain in enumerate(chains):
        for k in chain:
            if k in seen:
                raise ReconError(f"{ep.path}: call {nodes[k].call.call_index} falls in segments {seen[k]} and {s}; "
                                 "its completion would train twice (a linking bug: please report it)")
            seen[k] = s
    return chains


def unlinked_exclusions(nodes: list[Node]) -> list[tuple[int, str]]:
    """(call row, reason) of the calls linking left out of training (auxiliary, failed, RETRY)."""
    out = []
    for n in nodes:
        if n.kind == RETRY:
            out.append((n.call.row, "rejected retry"))
        elif n.kind in (AUX, ERROR):
            out.append((n.call.row, reason_of(n.note)))
    return out


def token_sequences(ep: Episode, m: TurnMarkers, nodes: list[Node] | None = None, *, max_len: int | None = None,
                    exclude_retries: bool = False, excluded: list[tuple[int, str]] | None = None) -> list[Sequence]:
    """One sequence per segment. Each call joins its row only if the row's context then aligns with
    the prompt the call was served (fidelity.context_alignment: known re-renders only) and the row
    stays within `max_len`; otherwise the row ends before it and the call starts a new row from its
    own served prompt (a call boundary: nothing is truncated). A call longer than `max_len` alone
    is left out. `excluded` receives (call row, reason) of every sampled completion not trained."""
    nodes = nodes if nodes is not None else link_calls(ep.calls, m, exclude_retries=exclude_retries)
    sink: list[tuple[int, str]] = excluded if excluded is not None else []
    sink.extend(unlinked_exclusions(nodes))
    out: list[Sequence] = []

    def close(calls, pieces, spans, n_realign):
        if not calls:
            return
        seq = _pieces_to_sequence(ep, len(out), calls, pieces, n_realign)
        seq.realign_tokens = span_tokens(spans, len(seq.input_ids))
        seq.realign_classes = sorted(frozenset().union(*(sp[4] for sp in spans))) if spans else []
        out.append(seq)

    for chain in trained_chains(ep, nodes):
        calls: list[Call] = []
        pieces: list = []
        spans: list = []
        n_realign = length = 0
        row = np.zeros(0, np.int32)
        for k in chain:
            node, call = nodes[k], nodes[k].call
            a = None
            if calls and node.kind in (CLEAN, REALIGN):
                context = np.concatenate([row, call.prompt[node.keep_from:]])
                if max_len is None or len(context) + len(call.completion) <= max_len:
                    a = _extends(node, calls[-1], row, context, call, m)
                if a is None:  # a row boundary: this call starts its own row from its served prompt
                    too_long = max_len is not None and len(context) + len(call.completion) > max_len
                    node.kind, node.keep_from, node.realigned = FORK, 0, 0
                    if node.parent is not None:  # detached: segments() from now on yields these rows
                        nodes[node.parent].children.remove(k)
                        node.parent = None
                    node.note = "row split at --max-len" if too_long else "context differs from the served prompt"
            if a is None:
                close(calls, pieces, spans, n_realign)
                calls, pieces, spans, n_realign, length = [], [], [], 0, 0
                if max_len is not None and len(call.prompt) + len(call.completion) > max_len:
                    sink.append((call.row, "longer than max_len"))
                    row, length = np.zeros(0, np.int32), 0
                    continue
                context = call.prompt
            else:
                spans.extend(a.spans)
                n_realign += node.realigned
            pieces.append((context[length:], 0, None))
            pieces.append((call.completion, 1, call.logprobs))
            calls.append(call)
            row = np.concatenate([context, call.completion])
            length = len(row)
        close(calls, pieces, spans, n_realign)
    return out


def _extends(node: Node, prev: Call, row: np.ndarray, context: np.ndarray, call: Call, m: TurnMarkers):
    """The alignment of `context` (the row so far + this call's new prompt tokens) with the call's
    served prompt, or None. Fast path: when the previous call's served prompt is an exact prefix of
    this one (node.prefix), the row up to the previous completion was already verified against it,
    and the link's own alignment (previous completion + new tokens vs the rest of the prompt) is
    the rest of the proof: its spans move into row coordinates. Otherwise the whole row is aligned."""
    start_prev = len(row) - len(prev.completion)
    if node.prefix >= len(prev.prompt) and start_prev >= 0:
        off = start_prev - len(prev.prompt)
        spans = tuple((p0 + off, p1 + off, i0, i1, c) for p0, p1, i0, i1, c in node.spans)
        return Alignment(len(call.prompt), node.prefix + off, node.realigned, 0, 0, spans)
    return context_alignment(context, call.prompt, m)


def per_call_sequences(ep: Episode, *, max_len: int | None = None,
                       excluded: list[tuple[int, str]] | None = None) -> list[Sequence]:
    """Every usable call its own row: its served prompt exactly (the fidelity baseline)."""
    sink: list[tuple[int, str]] = excluded if excluded is not None else []
    out = []
    for c in ep.calls:
        if not c.usable:
            sink.append((c.row, reason_of(c.why_unusable or "error")))
        elif max_len is not None and len(c.prompt) + len(c.completion) > max_len:
            sink.append((c.row, "longer than max_len"))
        else:
            out.append(_pieces_to_sequence(ep, len(out), [c], [(c.prompt, 0, None), (c.completion, 1, c.logprobs)], 0))
    return out


# ---------------------------------------------------------------------------------------------
# retokenize: the text baseline


class Retokenizer:
    """Renders conversations with the model's chat template (transformers) and tokenizes them."""

    def __init__(self, tokenizer_dir: str | Path = DEFAULT_TOKENIZER):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        self.start_text = "<|im_start|>assistant\n"
        self.end_text = "<|im_end|>"

    def render(self, request: dict[str, Any], dialect: str | None = "vllm") -> str:
        """The chat request rendered as the server renders it (polar_contracts/chat/render.py: content parts joined,
        arguments decoded, tools dumped, per server)."""
        try:
            return render_text(self.tok, request, render_rules(dialect))
        except (RequestError, ValueError) as exc:
            raise ReconError(f"request cannot be rendered: {exc}") from exc

    def sequence(self, text: str, sampled_turns: list[tuple[np.ndarray, np.ndarray]]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokenize `text`; mask 1 on assistant turn bodies; logprobs by position in each turn,
        taken from the sampled turns in order (the last ones when the text has fewer turns)."""
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        starts = np.asarray([o[0] for o in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(ids), np.int8)
        lps = np.zeros(len(ids), np.float32)
        spans = _assistant_spans(text, self.start_text, self.end_text)
        turns = sampled_turns[-len(spans):] if spans else []
        offset = len(spans) - len(turns)
        for t, (a, b) in enumerate(spans):
            sel = np.flatnonzero((starts >= a) & (starts < b))
            mask[sel] = 1
            if t >= offset:
                lp = turns[t - offset][1]
                n = min(len(sel), len(lp))
                lps[sel[:n]] = lp[:n]
        return ids, mask, lps


def _assistant_spans(text: str, head: str, end: str) -> list[tuple[int, int]]:
    spans, pos = [], 0
    while True:
        a = text.find(head, pos)
        if a < 0:
            return spans
        a += len(head)
        b = text.find(end, a)
        b = len(text) if b < 0 else b + len(end)
        spans.append((a, b))
        pos = b


def retokenize_sequences(ep: Episode, m: TurnMarkers, retok: Retokenizer, nodes: list[Node] | None = None) -> list[Sequence]:
    if not ep.requests:
        raise ReconError(f"{ep.path}: retokenize needs the request text (read the episode with requests)")
    nodes = nodes if nodes is not None else link_calls(ep.calls, m)
    out = []
    for s, chain in enumerate(trained_chains(ep, nodes)):
        calls = [nodes[k].call for k in chain]
        last = calls[-1]
        raw = ep.requests[last.row]
        try:
            request = json.loads(raw) if raw else None
        except json.JSONDecodeError as exc:
            raise ReconError(f"{ep.path}: call {last.call_index}: request is not JSON ({exc})") from exc
        if not isinstance(request, dict):
            raise ReconError(f"{ep.path}: call {last.call_index}: no request recorded")
        request = as_chat_request(request, last.info.get("api"))
        text = (retok.render(request, last.info.get("dialect"))
                + retok.tok.decode(last.completion.tolist(), skip_special_tokens=False))
        ids, mask, lps = retok.sequence(text, [(c.completion, c.logprobs) for c in calls])
        out.append(Sequence(ep.episode_id, s, ids, mask, lps, len(calls), 0,
                            oldest_version([c.info.get("weight_version") for c in calls]),
                            calls[0].info.get("model"), [c.call_index for c in calls],
                            **chain_sampling(calls), termination=termination(ep, calls),
                            isolation=isolation(ep), control_plane=control_plane(ep), realign_tokens=None,
                            call_rows=[c.row for c in calls]))
    return out


# ---------------------------------------------------------------------------------------------
# Responses / Messages requests as the chat request the proxy sent upstream


def as_chat_request(request: dict[str, Any], api: str | None) -> dict[str, Any]:
    """The chat-completions body the server rendered. Responses and Messages requests go through
    the translators the capture proxy runs (polar_contracts.translate), so reconstruction renders
    exactly what the proxy sent upstream."""
    to_chat = {"responses": responses_to_chat, "messages": messages_to_chat, "gemini": gemini_to_chat}.get(api or "")
    if to_chat is None:
        return request
    try:
        return to_chat(request)
    except ValueError as exc:
        raise ReconError(f"{api} request cannot be translated to chat: {exc}") from exc
