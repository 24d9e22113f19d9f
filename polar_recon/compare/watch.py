"""``polar-recon compare ... --html FILE --watch SECONDS``: the report of a run that is still running.

Every SECONDS the report is built again from what is on disk (run.run_compare, the same as one
``compare``) and FILE replaced whole; the page asks the browser to reload itself every SECONDS, so
an open tab follows the run. A round that cannot build a report yet (a run that wrote no logs so
far) says why and the watch goes on. Ctrl-C stops it (exit 0, as ``polar-recon watch``).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .run import CompareError

HEAD = "<head>"


def with_refresh(page: str, seconds: float) -> str:
    """The page with a reload every ``seconds`` (an http-equiv refresh in its head)."""
    meta = f"<meta http-equiv='refresh' content='{max(1, round(seconds))}'>"
    return page.replace(HEAD, HEAD + meta, 1) if HEAD in page else meta + page


def add_refresh(html_path: str | Path, seconds: float) -> None:
    path = Path(html_path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(with_refresh(path.read_text(encoding="utf-8"), seconds), encoding="utf-8")
    tmp.replace(path)


def episodes_in(report: dict) -> int:
    return sum(int((h.get("episodes") or {}).get("logs") or 0) for h in (report.get("harnesses") or {}).values())


def watch(build: Callable[[], dict], html_path: str | Path, seconds: float, *, echo: Callable[[str], None],
          rounds: int | None = None, sleep: Callable[[float], None] = time.sleep) -> int:
    """Run ``build`` (it writes ``html_path``) every ``seconds`` until Ctrl-C, or ``rounds`` times."""
    if not seconds > 0:
        raise CompareError(f"--watch takes seconds > 0, not {seconds}")
    done = 0
    try:
        while rounds is None or done < rounds:
            done += 1
            now = time.strftime("%H:%M:%S")
            try:
                report = build()
            except CompareError as exc:
                echo(f"{now} no report yet: {exc} (again in {seconds:g}s; Ctrl-C stops)")
            else:
                add_refresh(html_path, seconds)
                echo(f"{now} wrote {html_path}: {len(report.get('harnesses') or {})} harness(es), "
                     f"{episodes_in(report)} episode logs (again in {seconds:g}s; Ctrl-C stops)")
            if rounds is None or done < rounds:
                sleep(seconds)
    except KeyboardInterrupt:
        echo("stopped")
    return 0
