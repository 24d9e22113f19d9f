"""The live progress views (rich): episodes per phase, statuses, rewards so far, throughput; for
`run` (one pipeline) and for `fleet` (per node)."""
from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from harness_recipes.node.scheduler import PHASES, Pipeline


def make_console() -> Console:
    """stderr; piped (CI logs, `| tee`) as wide as a line needs, not rich's default 80 columns,
    which cuts the tables and wraps the per-episode lines."""
    return Console(stderr=True, width=None if sys.stderr.isatty() else 200)


def shown_changes(files: list[str]) -> list[str]:
    """The changed files worth a glance: not the bytecode a Python run leaves behind."""
    return [f for f in files if "__pycache__/" not in f and not f.endswith((".pyc", ".pyo"))]


def summary_table(p: Pipeline, title: str = "polar-rollout") -> Table:
    s = p.stats
    t = Table(title=title, show_header=True, header_style="bold")
    for ph in PHASES:
        t.add_column(ph, justify="right")
    t.add_column("reward (mean)", justify="right")
    t.add_column("episodes/s", justify="right")
    t.add_column("run-slot use", justify="right")
    wall = max(s.wall(), 1e-9)
    mean = f"{sum(s.rewards) / len(s.rewards):.3f}" if s.rewards else "-"
    util = s.run_busy / (wall * (1 if p.limits.sequential else p.limits.run))
    t.add_row(*(str(s.phase_counts[ph]) for ph in PHASES), mean, f"{s.finished / wall:.3f}", f"{util:.0%}")
    if s.statuses or s.skipped:
        t.caption = ", ".join(f"{k}: {v}" for k, v in sorted(s.statuses.items())) + (
            f"; skipped (finished before): {s.skipped}" if s.skipped else "")
    return t


class Progress:
    """A rich Live view on a terminal; one plain line per finished episode otherwise (CI logs)."""

    def __init__(self, enabled: bool = True, console: Console | None = None):
        self.console = console or make_console()
        self.live_mode = enabled and sys.stderr.isatty()
        self.live: Live | None = None
        self._last = 0.0
        self._printed: set[str] = set()

    def __enter__(self):
        if self.live_mode:
            self.live = Live(console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, p: Pipeline) -> None:
        if self.live is not None:
            now = time.monotonic()
            if now - self._last > 0.1 or p.stats.finished == len(p.jobs):
                self.live.update(summary_table(p))
                self._last = now
            return
        for j in p.jobs:
            if j.phase != "finished" or j.eid in self._printed:
                continue
            self._printed.add(j.eid)
            r = j.record
            self.console.print(f"[rollout] {r['episode_id']}: {r['status']} reward={r['reward']} "
                               f"calls={r.get('n_calls', '?')} changed={shown_changes(r.get('changed_files', []))}"
                               + (f" error={r['error'][:300]}" if r.get("error") else ""), soft_wrap=True)


class FleetView:
    """Per-node phase counts and the fleet's episodes/s: a rich Live table on a terminal, else a
    plain line every few seconds (--no-progress, CI logs)."""

    def __init__(self, enabled: bool = True, every_s: float = 5.0):
        self.console = make_console()
        self.live_mode = enabled and sys.stderr.isatty()
        self.live = None
        self.every, self._last = every_s, 0.0

    def __enter__(self):
        if self.live_mode:
            self.live = Live(console=self.console, refresh_per_second=2)
            self.live.__enter__()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, stats: list[dict], queue: dict, wall: float) -> None:
        done = sum(s.get("finished", 0) for s in stats)
        rate = done / max(wall, 1e-9)
        if self.live is not None:
            t = Table(title=f"polar-rollout fleet: {done} episodes, {rate:.2f}/s; groups {queue['groups']}")
            t.add_column("node")
            for ph in PHASES:
                t.add_column(ph, justify="right")
            t.add_column("state")
            for s in stats:
                ph = s.get("phases", {})
                t.add_row(s["node"], *(str(ph.get(p, "")) for p in PHASES), s.get("note") or s.get("error", "")[:40])
            self.live.update(t)
            return
        if time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            nodes = "; ".join(f"{s['node']}: {s.get('finished', 0)} done, "
                              f"{s.get('phases', {}).get('run', 0)} running ({s.get('note') or 'lost'})" for s in stats)
            self.console.print(f"[fleet] {done} episodes, {rate:.2f}/s, groups {queue['groups']} | {nodes}")
