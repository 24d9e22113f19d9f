"""Linking the calls of one episode into a tree, and the tree into segments (sans-IO, numpy only).

For each call, the parent is the earlier call whose prompt+completion is the longest prefix of
its prompt, compared at TURN BOUNDARIES rather than token by token: a harness re-renders the
assistant turns it sends back (thinking dropped, whitespace content, re-serialized arguments) and
BPE may even merge the first re-rendered token into the previous prompt's last token
(`<|im_start|>assistant\\n` + `\\n\\n` -> `assistant` `\\n\\n\\n`). So the alignment walks both
sequences; where they differ it requires the difference to sit inside an assistant turn (after its
`<|im_start|>assistant` header, before its `<|im_end|>`) and resumes after that turn's end in each.
Among the candidates that align, the parent is the one with the most of its tokens found again in
the prompt (`Alignment.matched`).

A differing turn is accepted only when the difference is a KNOWN re-render (rerender.py names
the classes and recognises each by what it is: thinking dropped, whitespace-only content, the
newline before a tool call, re-serialized arguments, the BPE merge at `assistant\\n`, ...). An
edited assistant message or rewritten tool-call arguments align with no parent: a FORK, whose
row starts from its own served prompt. Every accepted span is recorded (`Alignment.spans`) so the
row can say how many of its context tokens differ from what the model was served.

Kinds: CLEAN (the prompt extends the parent token for token), REALIGN (it extends it up to
re-rendered assistant turns of known classes), FORK (no usable parent: a new segment). Calls left
out of training: AUX (flagged auxiliary by the capture), ERROR (no ids / failed), RETRY (only with
`exclude_retries`: a sibling with the same prompt, from another call, whose branch no later call
extends while another's is). By default same-prompt siblings (n>1 choices, retried samples,
sub-agents with identical prompts) all train, each in its own segment.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from polar_contracts.log.arrays import Call
from polar_contracts.prefix import common_prefix

from .rerender import classify
from .tokens import TurnMarkers

CLEAN, REALIGN, FORK = "CLEAN", "REALIGN", "FORK"
AUX, ERROR, RETRY = "AUX", "ERROR", "RETRY"

# ---------------------------------------------------------------------------------------------
# alignment of one prompt against one candidate parent sequence


def _first(seq: np.ndarray, token: int, start: int) -> int | None:
    # in growing windows: the turn end is near, and scanning to the end of a 32k-token sequence
    # for every re-rendered turn made a row's checks quadratic
    n, step = len(seq), 512
    while start < n:
        hit = np.flatnonzero(seq[start:start + step] == token)
        if len(hit):
            return start + int(hit[0])
        start += step
        step *= 4
    return None


@dataclass(frozen=True)
class Alignment:
    keep_from: int  # position in the child's prompt where its new tokens start
    prefix: int  # exact common prefix of the child's prompt and the parent's sequence
    realigned: int  # assistant turns the child's prompt holds re-rendered
    suffix: int  # tokens the re-rendered turns share at their ends with the sampled ones (tie-break)
    # parent tokens found again in the prompt: the exact runs between re-rendered turns plus the
    # shared ends of those turns. The parent with the most is the one the prompt really extends:
    # `prefix` alone cannot tell, because a new user query strips the thinking of EVERY earlier
    # turn, so all candidates diverge at the same first think block.
    matched: int = 0
    # the re-rendered spans: (parent start, parent end, prompt start, prompt end, classes) of the
    # differing middle of each realigned turn (its shared head and tail excluded)
    spans: tuple = ()

    @property
    def classes(self) -> frozenset[str]:
        return frozenset().union(*(sp[4] for sp in self.spans)) if self.spans else frozenset()


def turn_classes(old: np.ndarray, new: np.ndarray, m: TurnMarkers) -> frozenset[str] | None:
    """The re-render classes between a sampled turn `old` and its served form `new` (both from
    their `<|im_start|>`), or None when the served one is not a known re-render of it."""
    # the same pair recurs: every later call of a row re-checks the row's earlier re-rendered turns
    return _turn_classes(m, old.astype(np.int32, copy=False).tobytes(), new.astype(np.int32, copy=False).tobytes())


@functools.lru_cache(maxsize=4096)
def _turn_classes(m: TurnMarkers, old_b: bytes, new_b: bytes) -> frozenset[str] | None:
    old, new = np.frombuffer(old_b, np.int32), np.frombuffer(new_b, np.int32)
    h = 1 + len(m.assistant)
    try:
        a, b = m.decode(old[h:]), m.decode(new[h:])
    except ValueError:
        # An id the tokenizer has no text for: models pad their embedding past the tokenizer (Qwen3:
        # 151936 rows, 151669 tokens) and a drifting policy does sample those rows. The served text has
        # nothing for it, so the re-render lost a sampled token: no known class, a FORK.
        return None
    found = classify(a, b)
    if found is None:
        return None
    if len(old) > h and len(new) > h and old[h] != new[h]:
        x, y = m.decode(old[h:h + 1]), m.decode(new[h:h + 1])
        if x != y and x.startswith("\n") and y.startswith("\n") and (x.strip() == "" or y.strip() == ""):
            found = found | {"bpe-merge"}
    if not found:  # the same text in other tokens
        found = frozenset({"bpe-merge"})
    return found


def align(parent: np.ndarray, prompt: np.ndarray, m: TurnMarkers, known_prefix: int | None = None) -> Alignment | None:
    """How `prompt` extends `parent` (a call's prompt+completion), or None if it does not.
    `known_prefix`: their exact common prefix length, when already known."""
    j = i = 0
    realigned = suffix = matched = 0
    spans: list = []
    prefix = None
    role = np.asarray(m.assistant, dtype=parent.dtype)
    while True:
        if prefix is None and known_prefix is not None:
            n = known_prefix
        else:
            n = common_prefix(parent[j:], prompt[i:])
        if prefix is None:
            prefix = n
        matched += n
        if j + n == len(parent):
            return Alignment(i + n, prefix, realigned, suffix, matched, tuple(spans))
        if i + n == len(prompt):
            return None  # the prompt stops inside the parent: a retry or an earlier point
        div = j + n  # first differing position in parent
        starts = np.flatnonzero(parent[j:div + 1] == m.start)
        if not len(starts):
            return None
        b = j + int(starts[-1])  # the turn the difference sits in
        if div < b + 1 + len(role) or not np.array_equal(parent[b + 1:b + 1 + len(role)], role):
            return None  # differs in a header, or not an assistant turn: history was edited
        e_p = _first(parent, m.end, b)
        if e_p is not None and e_p < div:
            return None  # differs between turns
        e_i = _first(prompt, m.end, i + n)
        if e_i is None:
            return None
        bi = i + (b - j)
        old, new = parent[b:len(parent) if e_p is None else e_p + 1], prompt[bi:e_i + 1]
        head = div - b  # the turn's leading tokens the exact run above already matched
        tail = min(common_prefix(old[::-1], new[::-1]), len(old) - head, len(new) - head)
        classes = turn_classes(old, new, m)
        if classes is None:
            return None  # not a known re-render: the harness changed this turn
        spans.append((div, b + len(old) - tail, bi + head, bi + len(new) - tail, classes))
        suffix += tail
        matched += tail
        realigned += 1
        if e_p is None:  # the sampled turn stopped without <|im_end|> (length cut): the template
            return Alignment(e_i, prefix, realigned, suffix, matched, tuple(spans))  # closed it: its <|im_end|> is context
        j, i = e_p + 1, e_i + 1


# ---------------------------------------------------------------------------------------------
# the call tree of one episode


@dataclass
class Node:
    call: Call
    kind: str
    parent: int | None = None  # index into the episode's node list
    keep_from: int = 0
    realigned: int = 0
    prefix: int = 0
    children: list[int] = field(default_factory=list)
    segment: int | None = None
    note: str = ""
    spans: tuple = ()  # the link's re-rendered spans (Alignment.spans), in the parent's coordinates


def _seq(call: Call) -> np.ndarray:
    if call.seq is not None and len(call.seq) == len(call.prompt) + len(call.completion):
        return call.seq
    return np.concatenate([call.prompt, call.completion])


def link_calls(calls: list[Call], m: TurnMarkers, *, exclude_retries: bool = False) -> list[Node]:
    """One node per call, in call order, with its parent and link kind. `exclude_retries`: mark
    rejected retries RETRY (left out, counted) instead of training each in its own segment."""
    nodes: list[Node] = []
    cands: list[tuple[int, np.ndarray]] = []  # (node index, prompt+completion) of usable calls
    row_to_node: dict[int, int] = {}  # file row -> node, for the writer's base-row hint
    for call in calls:
        why = call.why_unusable
        if why is not None:
            nodes.append(Node(call, AUX if why == "auxiliary" else ERROR, note=why))
            continue
        node = Node(call, FORK)
        best: tuple[tuple[int, int, int, int], int, Alignment] | None = None
        hint = row_to_node.get(call.base_row)
        order = sorted(cands, key=lambda c: (len(c[1]), c[0]), reverse=True)
        if hint is not None:  # the writer's longest match first: its prefix length is known
            order = [c for c in order if c[0] == hint] + [c for c in order if c[0] != hint]
        # then longest sequences first: a candidate shorter than the best match cannot beat it
        # (matched <= len(seq))
        for idx, seq in order:
            if best is not None and len(seq) < best[0][0]:
                continue
            known = call.base_len if idx == hint and call.base_len <= min(len(seq), len(call.prompt)) else None
            a = align(seq, call.prompt, m, known)
            if a is None:
                continue
            # most of the parent found again, then the longest exact prefix (a retry sibling whose
            # turn was replaced matches less of it), then the shared turn ends, then the latest
            key = (a.matched, a.prefix, a.suffix, idx)
            if best is None or key > best[0]:
                best = (key, idx, a)
        if best is not None:
            _, idx, a = best
            node.parent, node.keep_from, node.realigned, node.prefix = idx, a.keep_from, a.realigned, a.prefix
            node.spans = a.spans
            node.kind = REALIGN if a.realigned else CLEAN
            nodes[idx].children.append(len(nodes))
        cands.append((len(nodes), _seq(call)))
        row_to_node[call.row] = len(nodes)
        nodes.append(node)
    if exclude_retries:
        _drop_retries(nodes)
    return nodes


def _drop_retries(nodes: list[Node]) -> None:
    """Siblings with the same prompt from different calls are retries: keep those that later calls
    extend (or, when none is extended, the last one); the others become RETRY and leave the tree.
    The n>1 choices of one call are never retries (the server sampled them all at once)."""
    by_parent: dict[tuple[int | None, int], list[int]] = {}
    for k, n in enumerate(nodes):
        if n.kind in (CLEAN, REALIGN, FORK):
            by_parent.setdefault((n.parent, len(n.call.prompt)), []).append(k)
    groups: list[list[int]] = []
    for cands in by_parent.values():  # same parent, same prompt length: compare the prompts
        while cands:
            first, rest = cands[0], cands[1:]
            same = [k for k in rest if np.array_equal(nodes[k].call.prompt, nodes[first].call.prompt)]
            groups.append([first, *same])
            cands = [k for k in rest if k not in same]
    for members in groups:
        if len(members) < 2:
            continue
        extended = [k for k in members if nodes[k].children]
        keep = set(extended) if extended else {members[-1]}
        kept_calls = {nodes[k].call.call_index for k in keep}
        for k in members:
            if k in keep or nodes[k].call.call_index in kept_calls:
                continue
            n = nodes[k]
            n.note = f"retry of call {nodes[min(keep)].call.call_index}; not extended"
            n.kind = RETRY
            if n.parent is not None:
                nodes[n.parent].children.remove(k)


def _latest(nodes: list[Node], k: int) -> int:
    """The latest node index in k's subtree: the branch later calls extend is the one kept going."""
    best, stack = k, [k]
    while stack:
        x = stack.pop()
        best = max(best, x)
        stack.extend(nodes[x].children)
    return best


def segments(nodes: list[Node]) -> list[list[int]]:
    """Chains of node indices, one per training sequence. A node whose parent already continues
    into a later branch starts its own segment (a FORK: its prompt becomes context)."""
    chains: list[list[int]] = []
    roots = [k for k, n in enumerate(nodes) if n.kind in (CLEAN, REALIGN, FORK) and n.parent is None]
    pending = list(roots)
    while pending:
        pending.sort()
        k = pending.pop(0)
        chain = [k]
        while nodes[chain[-1]].children:
            kids = nodes[chain[-1]].children
            main = max(kids, key=lambda c: _latest(nodes, c))
            for c in kids:
                if c != main:
                    nodes[c].kind, nodes[c].note = FORK, f"branch: call {nodes[chain[-1]].call.call_index} continues elsewhere"
                    nodes[c].parent, nodes[c].keep_from, nodes[c].realigned = None, 0, 0
                    pending.append(c)
            # the detached branches leave the tree: the nodes then describe these segments, and
            # calling segments() again (drift, html, token then retokenize) yields the same chains
            # instead of each branch twice (as a root AND again as a branch: trained twice)
            nodes[chain[-1]].children = [main]
            chain.append(main)
        for x in chain:
            nodes[x].segment = len(chains)
        chains.append(chain)
    chains.sort(key=lambda ch: ch[0])
    for s, ch in enumerate(chains):
        for x in ch:
            nodes[x].segment = s
    return chains
