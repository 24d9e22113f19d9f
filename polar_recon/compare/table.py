"""The terminal summary of `polar-recon compare`: one column per harness, one line per number; the
same lines head the HTML page (page.py), so both say the same thing."""
from __future__ import annotations

from typing import Any


def _n(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _dist(d: dict | None, digits: int = 1) -> str:
    return "-" if not d else f"{_n(d['mean'], digits)} (max {_n(d['max'], digits)})"


def _ci(ci: list[float] | None, digits: int = 2, pct: bool = False) -> str:
    if not ci:
        return ""
    f = (lambda x: f"{100 * x:.0f}%") if pct else (lambda x: f"{x:.{digits}f}")
    return f" [{f(ci[0])}, {f(ci[1])}]"


def _counts(c: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "-"


def _verdict_rates(by_version: dict[str, dict]) -> str:
    """``v1: 12% / 0% / 4% of 50``: each policy version's discard, eval-error and tampered rates."""
    return "; ".join(f"{v}: {_pct(c['rates']['discarded'])} / {_pct(c['rates']['eval_error'])} / "
                     f"{_pct(c['rates']['tampered'])} of {c['episodes']}" for v, c in by_version.items()) or "-"
def _ledger_lines(led: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The coverage ledger: what share of the sampled completion tokens the manifests account
    for, and train."""
    if not led or not led["episodes"]:
        return [("sampled tokens accounted for (ledger)", "-")]
    out = [("sampled tokens accounted for (ledger)",
            f"{_pct(led['accounted_share'])} of {_n(led['sampled'])}, {_pct(led['trained_share'])} trained"),
           ("  excluded tokens, by reason", _counts({k: v for k, v in led["excluded"].items() if v}))]
    if led["episodes_without_ledger"]:
        out.append(("  built episodes without a ledger", _n(led["episodes_without_ledger"])))
    return out


def lines(h: dict[str, Any], trainer: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(label, value) pairs of one harness, in the table's order."""
    e, c, r, f, rw = h["episodes"], h["calls"], h["rows"], h["fidelity"], h["reward"]
    ph = h["phases_s"]
    # without capture logs these numbers cannot be known: say where they would come from
    no_logs = " (no capture logs read: --logdir LOGDIR)" if c["source"] == "shards" else ""
    out = [
        ("episodes (rollout records)", _n(e["recorded"])),
        ("  by status", _counts(e["by_status"])),
        ("  built into shards", _n(e["built"])),
        ("  excluded, by reason", _counts(e["excluded"])),
        ("  errors (error/crashed/eval_error)", _n(e["errors"])),
        (f"calls / episode ({c['source']})", _dist(c.get("calls_per_episode"))),
        ("prompt tokens / episode", _dist(c.get("prompt_tokens_per_episode"), 0) + no_logs),
        ("completion tokens / episode", _dist(c.get("completion_tokens_per_episode"), 0) + no_logs),
        ("row tokens / episode (shards)", _dist(r["tokens_per_episode"], 0)),
        ("trainable-token share", _pct(r["trainable_share"])),
    ]
    for p in ("prewarm", "agent", "eval", "recon"):
        out.append((f"{p} s / episode", _dist(ph.get(p), 2)))
    out += [
        ("model-call share of agent time", _pct(c.get("model_share_of_agent"))),
        ("call ms (p50 / max)", ("-" + no_logs) if not c.get("call_ms") else
         f"{c['call_ms']['p50']:.0f} / {c['call_ms']['max']:.0f}"),
        ("reward mean [95% CI]", _n(rw["mean"], 3) + _ci(rw["ci95"], 3)
         + (f" ({rw['source']})" if rw.get("source", "shards") != "shards" else "")),
        (f"solve rate (reward >= {rw['solved_at']:g}) [95% CI]",
         ("-" if rw["solve_rate"] is None else f"{_pct(rw['solve_rate'])} ({rw['solved']}/{rw['n']})")
         + _ci(rw["solve_ci95"], pct=True)),
        ("termination (episodes)", _counts(h["terminations"]["episodes"])),
        ("re-rendered context tokens", f"{_n(f['realign_tokens'])} of {_n(f['context_tokens'])} "
                                       f"({100 * f['realign_share']:.2f}%)"),
        ("  by class (tokens)", ", ".join(f"{k} {v['tokens']}" for k, v in f["classes"].items()) or "-"),
        ("  worst episode", "-" if not f["worst_rerender"] else
         f"{f['worst_rerender']['episode']} ({f['worst_rerender']['tokens']} tok)"),
        ("chain breaks (new segments)", f"{f['chain_breaks']} in {f['episodes_with_breaks']} episodes"),
        ("samples not trained, by reason", _counts(h["not_trained"]["samples"])),
        ("discard / eval_error / tampered by version", _verdict_rates(h.get("verdicts_by_version") or {})),
        *_ledger_lines(h.get("ledger")),
        ("longest episode (row tokens)", "-" if not r["tokens_per_episode"] else r["tokens_per_episode"]["max_episode"]),
    ]
    if h.get("drift"):
        d = h["drift"]
        out.append(("retokenize drift (trainable tokens)", f"{d['retokenize_differing_tokens']} of "
                    f"{d['trainable_tokens']} ({100 * d['retokenize_differing_share']:.2f}%)"))
    if trainer:
        s = trainer["summary"]
        last = s["last"]
        dists = s["distributions"]
        out += [
            ("trainer steps logged", _n(s["steps"])),
            ("  reward first -> last", "-" if "reward" not in last else f"{s['first']['reward']:.3f} -> {last['reward']:.3f}"),
            ("  IS ratio mean (over steps)", _dist(dists.get("sampling/importance_sampling_ratio/mean"), 3)),
            ("  IS masked share (over steps)", _dist(dists.get("sampling/importance_sampling_ratio/masked_frac"), 3)),
            ("  excluded share (last)", _pct(last.get("polar/excluded_share"))),
            ("  policy lag (mean over steps)", _dist(dists.get("polar/policy_lag"), 2)),
        ]
    return out


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    hs = report["harnesses"]
    t = Table(title="polar-recon compare: harnesses side by side")
    t.add_column("")
    cols = {name: dict(lines(h, report.get("trainers", {}).get(name))) for name, h in hs.items()}
    labels = []
    for c in cols.values():
        labels += [k for k in c if k not in labels]
    for name in hs:
        t.add_column(name, overflow="fold")
    for label in labels:
        t.add_row(label, *(cols[n].get(label, "-") for n in hs))
    Console(width=max(120, 40 + 34 * len(hs))).print(t)
