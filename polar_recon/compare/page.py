"""The HTML page of `polar-recon compare`: one self-contained file (plotly.js inlined once in the
head, every figure drawn by plotly from numbers the report already aggregated: box plots get their
five numbers, never one point per episode, so the page stays small at any store size). It opens
from disk with no network. Episode ids in it link to the token views written beside it (views.py).
"""
from __future__ import annotations

import html
import json
from typing import Any

from . import table
from .training import CURVES, DISTRIBUTIONS

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px;color:#222;background:#fafafa;max-width:1400px}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ccc}
.sub{color:#666;margin-bottom:12px} table{border-collapse:collapse;font-size:13px;background:#fff}
td,th{border:1px solid #ddd;padding:3px 8px;vertical-align:top} th{background:#eee;text-align:left}
td.k{color:#444;white-space:nowrap} .plot{background:#fff;border:1px solid #ddd;margin:10px 0;padding:4px}
.eps li{margin:2px 0} .note{color:#777;font-size:12px} code{font-size:12px}
"""
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def _fig_html(fig, div_id: str, height: int) -> str:
    import plotly.io as pio

    fig.update_layout(template="plotly_white", margin=dict(l=60, r=20, t=70, b=50), height=height)
    return "<div class='plot'>" + pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id,
                                              config={"displaylogo": False, "responsive": True}) + "</div>"


def _no_data(fig, why: str):
    """An empty figure says so: plotly would draw bare -1..1 axes, which read as a broken plot."""
    fig.add_annotation(text=f"no data: {why}", xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font=dict(size=16, color="#777"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _share_range(shares: list[float]) -> list[float]:
    """A share axis from 0 to at least 5%: a 0.07% share is drawn as the sliver it is, not as a full
    bar on an axis autoscaled to 0.07%."""
    return [0, max(0.05, 1.2 * max(shares, default=0.0))]


def _colors(names: list[str]) -> dict[str, str]:
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def _reward_fig(hs: dict[str, Any]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    names = list(hs)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("reward mean, 95% CI (within the rewards' range)",
                                                          "solve rate, 95% CI (Wilson)"))
    def err(vals, ci):
        return dict(type="data", symmetric=False, array=[(c[1] - v) if c else 0 for v, c in zip(vals, ci)],
                    arrayminus=[(v - c[0]) if c else 0 for v, c in zip(vals, ci)])
    mean = [hs[n]["reward"]["mean"] or 0 for n in names]
    fig.add_trace(go.Bar(x=names, y=mean, error_y=err(mean, [hs[n]["reward"]["ci95"] for n in names]),
                         name="reward", marker_color="#4c78a8"), 1, 1)
    solve = [hs[n]["reward"]["solve_rate"] or 0 for n in names]
    fig.add_trace(go.Bar(x=names, y=solve, error_y=err(solve, [hs[n]["reward"]["solve_ci95"] for n in names]),
                         name="solve rate", marker_color="#54a24b"), 1, 2)
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%", row=1, col=2)
    fig.update_layout(title="Reward and solve rate per harness", showlegend=False)
    if not any(hs[n]["reward"]["n"] for n in names):
        return _no_data(fig, "no episode has a reward (no shards, no end records)")
    return fig


def _box_fig(hs: dict[str, Any]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = (("prompt_tokens", "prompt tokens / episode"), ("completion_tokens", "completion tokens / episode"),
            ("calls", "calls / episode"))
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in keys])
    col = _colors(list(hs))
    for i, (k, _) in enumerate(keys, 1):
        for n, h in hs.items():
            q = (h["calls"].get("box") or {}).get(k)
            if not q:
                continue
            fig.add_trace(go.Box(x=[n], q1=[q["q1"]], median=[q["median"]], q3=[q["q3"]], lowerfence=[q["min"]],
                                 upperfence=[q["max"]], mean=[q["mean"]], name=n, marker_color=col[n],
                                 showlegend=i == 1), 1, i)
    fig.update_layout(title="Where each harness's tokens go (per episode, from the capture logs)")
    if not fig.data:
        return _no_data(fig, "no capture logs read (pass --logdir LOGDIR)")
    return fig


def _phase_fig(hs: dict[str, Any]):
    import plotly.graph_objects as go

    fig = go.Figure()
    for p, c in zip(("prewarm", "agent", "eval", "recon"), ("#9ecae9", "#4c78a8", "#f58518", "#72b7b2")):
        fig.add_trace(go.Bar(x=list(hs), y=[((h["phases_s"] or {}).get(p) or {}).get("mean") or 0 for h in hs.values()],
                             name=p, marker_color=c))
    fig.update_layout(barmode="stack", title="Wall time per phase (mean seconds per episode, rollout records)",
                      yaxis_title="seconds")
    if not any(h["phases_s"] for h in hs.values()):
        return _no_data(fig, "no rollout records (polar-rollout's OUT/rollout/episodes.jsonl)")
    return fig


def _fidelity_fig(hs: dict[str, Any]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("re-rendered share of context tokens, by class",
                                                        "chain breaks (new segments) per episode"))
    classes = sorted({c for h in hs.values() for c in h["fidelity"]["classes"]})
    for c in classes:
        fig.add_trace(go.Bar(x=list(hs), y=[h["fidelity"]["classes"].get(c, {}).get("share", 0) for h in hs.values()],
                             name=c), 1, 1)
    if not classes:  # an axis with nothing on it reads as a broken plot: say it is zero
        fig.add_trace(go.Bar(x=list(hs), y=[0 for _ in hs], name="no re-render"), 1, 1)
    fig.add_trace(go.Bar(x=list(hs), y=[h["fidelity"]["chain_breaks"] / max(1, h["episodes"]["built"])
                                        for h in hs.values()], name="breaks / episode", marker_color="#e45756",
                         showlegend=False), 1, 2)
    stacked = [sum(c.get("share", 0) for c in h["fidelity"]["classes"].values()) for h in hs.values()]
    fig.update_yaxes(tickformat=".2%", range=_share_range(stacked), row=1, col=1)
    fig.update_layout(barmode="stack", title="Context fidelity (shard fidelity columns)")
    if not any(h["fidelity"]["rows"] for h in hs.values()):
        return _no_data(fig, "no shard rows")
    return fig


def _termination_fig(hs: dict[str, Any]):
    import plotly.graph_objects as go

    kinds = sorted({k for h in hs.values() for k in h["terminations"]["episodes"]})
    fig = go.Figure()
    for k in kinds:
        fig.add_trace(go.Bar(x=list(hs), y=[h["terminations"]["episodes"].get(k, 0) for h in hs.values()], name=k))
    ex = sorted({k for h in hs.values() for k in h["episodes"]["excluded"]})
    for k in ex:
        fig.add_trace(go.Bar(x=list(hs), y=[h["episodes"]["excluded"].get(k, 0) for h in hs.values()],
                             name=f"excluded: {k}", marker_pattern_shape="/"))
    fig.update_layout(barmode="stack", title="How episodes ended (built: termination; left out: reason)",
                      yaxis_title="episodes", showlegend=True)
    if not kinds and not ex:
        return _no_data(fig, "no episode built or left out")
    return fig


def _version_fig(hs: dict[str, Any]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("reward mean by weight version", "solve rate by weight version"))
    col = _colors(list(hs))
    for n, h in hs.items():
        v = h["by_weight_version"]
        xs = [x["weight_version"] for x in v]
        fig.add_trace(go.Scatter(x=xs, y=[x["reward_mean"] for x in v], name=n, mode="lines+markers",
                                 line_color=col[n], text=[f"{x['episodes']} episodes" for x in v]), 1, 1)
        fig.add_trace(go.Scatter(x=xs, y=[x["solve_rate"] for x in v], name=n, mode="lines+markers",
                                 line_color=col[n], showlegend=False), 1, 2)
    fig.update_xaxes(type="category")
    fig.update_layout(title="Per policy version (the weight version that served each episode's first row)")
    if not any(h["by_weight_version"] for h in hs.values()):
        return _no_data(fig, "no shard rows")
    return fig


def _training_figs(trainers: dict[str, Any]) -> list:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = [k for k in CURVES if any(k in t["curves"] for t in trainers.values())]
    if not keys:
        return []
    cols = 3
    rows = (len(keys) + cols - 1) // cols
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=keys, vertical_spacing=0.5 / max(rows, 1))
    col = _colors(list(trainers))
    for i, k in enumerate(keys):
        for n, t in trainers.items():
            pts = t["curves"].get(k)
            if pts:
                fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], name=n, mode="lines+markers",
                                         line_color=col[n], legendgroup=n, showlegend=i == 0),
                              i // cols + 1, i % cols + 1)
    fig.update_layout(title="Training curves per harness (trainer log_history, x = step)")
    figs = [(fig, 260 * rows)]
    dk = [k for k in DISTRIBUTIONS if any(k in t["curves"] for t in trainers.values())]
    if dk:
        short = {"sampling/importance_sampling_ratio/mean": "IS ratio (mean per step)",
                 "sampling/importance_sampling_ratio/masked_frac": "IS masked share",
                 "polar/excluded_share": "excluded share", "polar/policy_lag": "policy lag"}
        d = make_subplots(rows=1, cols=len(dk), subplot_titles=[short.get(k, k) for k in dk])
        for i, k in enumerate(dk, 1):
            for n, t in trainers.items():
                pts = t["curves"].get(k)
                if pts:
                    d.add_trace(go.Box(y=[p[1] for p in pts], name=n, marker_color=col[n], showlegend=False,
                                       boxpoints="all"), 1, i)
        d.update_layout(title="Distributions over logged steps: IS ratio, masked share, excluded share, policy lag")
        figs.append((d, 380))
    return figs


def _episode_link(eid: str, views: dict[str, str]) -> str:
    v = views.get(eid)
    if v and not v.startswith("no view"):
        return f"<a href='{html.escape(v)}'>{html.escape(eid)}</a>"
    return f"<code title='{html.escape(v or '')}'>{html.escape(eid)}</code>"


def _linked(text: str, views: dict[str, str]) -> str:
    """A table cell with every episode id it names turned into a link to its token view."""
    out = html.escape(text)
    for eid in sorted(views, key=len, reverse=True):
        v = views[eid]
        if eid in text and not v.startswith("no view"):
            out = out.replace(html.escape(eid), f"<a href='{html.escape(v)}'>{html.escape(eid)}</a>")
    return out


def _episodes_section(name: str, h: dict[str, Any], views: dict[str, str]) -> str:
    def ul(title, ids, total=None):
        if not ids:
            return ""
        more = f" (first {len(ids)} of {total})" if total and total > len(ids) else ""
        return (f"<li><b>{html.escape(title)}</b>{more}: " + ", ".join(_episode_link(e, views) for e in ids) + "</li>")
    f, r, c = h["fidelity"], h["rows"], h["calls"]
    items = []
    if f["worst_rerender"]:
        items.append(ul(f"worst re-render ({f['worst_rerender']['tokens']} tokens)", [f["worst_rerender"]["episode"]]))
    if r["tokens_per_episode"]:
        items.append(ul(f"longest episode ({r['tokens_per_episode']['max']:.0f} row tokens)",
                        [r["tokens_per_episode"]["max_episode"]]))
    if c.get("calls_per_episode"):
        items.append(ul(f"most calls ({c['calls_per_episode']['max']:.0f})", [c["calls_per_episode"]["max_episode"]]))
    if c.get("prompt_tokens_per_episode"):
        items.append(ul(f"most prompt tokens ({c['prompt_tokens_per_episode']['max']:.0f})",
                        [c["prompt_tokens_per_episode"]["max_episode"]]))
    for p, d in (h.get("phases_s") or {}).items():
        if d:
            items.append(ul(f"slowest {p} phase ({d['max']:.2f} s)", [d["max_episode"]]))
    items.append(ul("with failed calls", c.get("failed_refs") or []))
    for k, ids in h["episodes"]["refs"]["excluded"].items():
        items.append(ul(f"excluded: {k}", ids, h["episodes"]["excluded"].get(k)))
    items.append(ul("errors", h["episodes"]["refs"]["errors"], h["episodes"]["errors"]))
    for k, ids in h["not_trained"]["refs"].items():
        items.append(ul(f"samples not trained: {k}", ids))
    items.append(ul("chain breaks", f["refs"]["breaks"], f["episodes_with_breaks"]))
    items.append(ul("unsolved", h["reward"]["refs"]["unsolved"], h["reward"]["n"] - h["reward"]["solved"]))
    body = "".join(x for x in items if x) or "<li>none named</li>"
    return f"<h3>{html.escape(name)}</h3><ul class='eps'>{body}</ul>"


def render(report: dict[str, Any], views: dict[str, dict[str, str]]) -> str:
    from plotly.offline import get_plotlyjs

    hs = report["harnesses"]
    trainers = report.get("trainers") or {}
    cols = {n: dict(table.lines(h, trainers.get(n))) for n, h in hs.items()}
    labels: list[str] = []
    for c in cols.values():
        labels += [k for k in c if k not in labels]
    rows = "".join(f"<tr><td class='k'>{html.escape(lab)}</td>"
                   + "".join(f"<td>{_linked(cols[n].get(lab, '-'), views.get(n, {}))}</td>" for n in hs) + "</tr>"
                   for lab in labels)
    figs = [(_reward_fig(hs), 380), (_box_fig(hs), 380), (_phase_fig(hs), 380), (_fidelity_fig(hs), 380),
            (_termination_fig(hs), 380), (_version_fig(hs), 380)] + _training_figs(trainers)
    plots = [_fig_html(fig, f"plot{i}", height) for i, (fig, height) in enumerate(figs)]
    embedded = json.dumps(report, default=str).replace("</", "<\\/")  # the --json report, for scripts
    srcs = "".join(f"<li><b>{html.escape(s['harness'])}</b>: <code>{html.escape(s['root'])}</code> "
                   f"({s['shards']} shards, {s['records']} record files)</li>" for s in report["sources"])
    return "\n".join([
        "<!doctype html><html><head><meta charset='utf-8'><title>polar-recon compare</title>",
        f"<style>{CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>",
        f"<h1>Harnesses side by side: {html.escape(', '.join(hs))}</h1>",
        "<div class='sub'>polar-recon compare: shards, rollout records and capture logs, grouped by harness; "
        "episode ids link to their token view (polar-recon show).</div>",
        f"<ul class='note'>{srcs}</ul>",
        "<h2>Summary</h2><table><tr><th></th>" + "".join(f"<th>{html.escape(n)}</th>" for n in hs) + "</tr>"
        + rows + "</table>",
        "<p class='note'>The proxy's own share of each call is not in the log (it records request-in, first "
        "byte and response-out at the proxy, not the upstream send); the model-call share of agent time is.</p>",
        "<h2>Plots</h2>", *plots,
        "<h2>The episodes behind the numbers</h2>",
        *(_episodes_section(n, h, views.get(n, {})) for n, h in hs.items()),
        f"<script type='application/json' id='polar-report'>{embedded}</script>",
        "</body></html>",
    ])
