"""`polar-recon show EPISODE --html FILE`: one self-contained page per episode.

Each segment (training sequence) is drawn token by token: context tokens (mask 0) in grey, the
tokens the model sampled (mask 1) on a background whose hue is the behaviour probability
(green = likely, red = unlikely; hover for id and logprob), a rule at every `<|im_start|>` with the
turn's role, and a badge where each call's tokens begin with its link kind. Calls that are left
out (auxiliary, failed, dropped retries) are listed in the table above.
"""
from __future__ import annotations

import html
import math
from pathlib import Path

import numpy as np

from polar_contracts.log.arrays import Episode

from .diagnostics import inspect_rows
from .link import CLEAN, REALIGN, link_calls, segments
from .strategies import token_sequences
from .tokens import DEFAULT_TOKENIZER, TurnMarkers

CSS = """
body{font:14px/1.5 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px} .sub{color:#666;margin-bottom:16px}
table{border-collapse:collapse;margin:8px 0 20px;font-size:12px} td,th{border:1px solid #ddd;padding:2px 6px}
th{background:#eee} tr.row-AUX,tr.row-ERROR,tr.row-RETRY{color:#999}
td.k-CLEAN{color:#2a7;font-weight:bold} td.k-REALIGN{color:#d80;font-weight:bold} td.k-FORK{color:#27c;font-weight:bold}
details{display:inline} summary{display:inline;cursor:pointer;color:#557;font:11px system-ui;background:#eef;border-radius:3px;padding:0 4px}
.legend span{display:inline-block;margin-right:14px}
.seg{background:#fff;border:1px solid #ddd;border-radius:6px;padding:12px;margin:16px 0}
.seg h2{font-size:15px;margin:0 0 8px}
.toks{font:12px/1.7 ui-monospace,monospace;white-space:pre-wrap;word-break:break-all}
.t0{color:#888} .t1{color:#000;border-radius:2px}
.turn{display:block;border-top:2px solid #99b;margin:6px 0 2px;padding-top:2px;font:11px system-ui;color:#557}
.call{display:inline-block;font:bold 11px system-ui;color:#fff;border-radius:3px;padding:0 5px;margin:0 3px}
.CLEAN{background:#2a7} .REALIGN{background:#d80} .FORK{background:#27c}
.sw{display:inline-block;width:14px;height:12px;vertical-align:middle;border:1px solid #ccc}
"""


def _color(lp: float) -> str:
    p = math.exp(min(0.0, float(lp)))
    return f"hsl({int(120 * p)},75%,82%)"


def _token_texts(ids: np.ndarray, tokenizer_dir) -> list[str]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return tok.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)


def render_episode(ep: Episode, m: TurnMarkers, tokenizer_dir=DEFAULT_TOKENIZER) -> str:
    nodes = link_calls(ep.calls, m)
    chains = segments(nodes)
    seqs = token_sequences(ep, m, nodes)
    rows = inspect_rows(ep, m)
    kinds = {}
    for n in nodes:
        kinds[n.kind] = kinds.get(n.kind, 0) + 1
    out = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>episode {html.escape(ep.episode_id)}</title><style>{CSS}</style></head><body>",
        f"<h1>Episode {html.escape(ep.episode_id)}</h1>",
        f"<div class='sub'>reward {ep.reward if ep.reward is not None else 'none'} &middot; "
        f"{'finished' if ep.finished else 'NOT finished'} &middot; {len(ep.calls)} calls &middot; "
        f"{len(seqs)} segments &middot; links: {html.escape(', '.join(f'{k} {v}' for k, v in sorted(kinds.items())))}</div>",
        "<div class='legend'><span><b class='sw' style='background:hsl(120,75%,82%)'></b> sampled, p&asymp;1</span>"
        "<span><b class='sw' style='background:hsl(0,75%,82%)'></b> sampled, p&asymp;0</span>"
        "<span class='t0'>grey: context (mask 0)</span>"
        "<span><b class='call CLEAN'>CLEAN</b><b class='call REALIGN'>REALIGN</b><b class='call FORK'>FORK</b></span></div>",
        _table(rows),
    ]
    for chain, seq in zip(chains, seqs):
        out.append(_segment(nodes, chain, seq, m, tokenizer_dir))
    out.append("</body></html>")
    return "\n".join(out)


def _table(rows) -> str:
    cols = ["call", "api", "prompt", "completion", "link", "parent", "new", "realigned", "segment", "ttfb_ms",
            "total_ms", "finish", "weights", "error"]
    head = "".join(f"<th>{c}</th>" for c in cols)

    def cell(r, c):
        v = html.escape("" if r[c] is None else str(r[c]))
        return f"<td class='k-{v}'>{v}</td>" if c == "link" else f"<td>{v}</td>"
    body = "".join(f"<tr class='row-{r['link']}'>" + "".join(cell(r, c) for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


# Context runs longer than this are folded (system prompts and tool lists dwarf what was sampled).
FOLD, KEEP = 120, 30


def _segment(nodes, chain, seq, m: TurnMarkers, tokenizer_dir) -> str:
    texts = _token_texts(seq.input_ids, tokenizer_dir)
    # where each call's tokens begin in the sequence, and its link kind
    badges, pos = {}, 0
    for k in chain:
        n = nodes[k]
        keep = n.keep_from if n.kind in (CLEAN, REALIGN) else 0
        extra = f" ({n.realigned} turn{'s' if n.realigned != 1 else ''})" if n.kind == REALIGN else ""
        badges[pos] = f"<b class='call {n.kind}' title='parent call {nodes[n.parent].call.call_index if n.parent is not None else '-'}'>call {n.call.call_index} &middot; {n.kind}{extra}</b>"
        pos += len(n.call.prompt) - keep + len(n.call.completion)
    cells = []
    ids, mask, lps = seq.input_ids, seq.loss_mask, seq.logprobs
    for i, text in enumerate(texts):
        pre = badges.get(i, "")
        if ids[i] == m.start:
            role = texts[i + 1].strip() if i + 1 < len(texts) else ""
            pre += f"<span class='turn'>{html.escape(role)} turn @ {i}</span>"
        shown = html.escape(text.replace("\n", "\u21b5\n"))
        if mask[i]:
            cells.append(pre + f"<span class='t1' style='background:{_color(lps[i])}' title='id {ids[i]} logprob {lps[i]:.3f}'>{shown}</span>")
        else:
            cells.append(pre + f"<span class='t0' title='id {ids[i]}'>{shown}</span>")
    parts = []
    d = np.diff(np.concatenate([[1], mask.astype(np.int8), [1]]))
    runs = list(zip(np.flatnonzero(d == -1).tolist(), np.flatnonzero(d == 1).tolist()))  # mask-0 runs
    pos = 0
    for a, b in runs:
        parts += cells[pos:a]
        if b - a > FOLD:
            parts += cells[a:a + KEEP]
            parts.append(f"<details><summary>&hellip; {b - a - 2 * KEEP} context tokens &hellip;</summary>"
                         + "".join(cells[a + KEEP:b - KEEP]) + "</details>")
            parts += cells[b - KEEP:b]
        else:
            parts += cells[a:b]
        pos = b
    parts += cells[pos:]
    title = (f"segment {seq.segment}: {len(ids)} tokens, {int(mask.sum())} trainable, {seq.n_calls} calls, "
             f"{seq.n_realign} realigned turns, prompt_len {seq.prompt_len}")
    return f"<div class='seg'><h2>{html.escape(title)}</h2><div class='toks'>{''.join(parts)}</div></div>"
