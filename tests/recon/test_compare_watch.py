"""`polar-recon compare ... --html FILE --watch SECONDS`: the report follows a run that is still
writing logs (polar_recon/compare/watch.py)."""
from __future__ import annotations

from click.testing import CliRunner

from polar_recon.cli import main
from polar_recon.compare.run import run_compare
from polar_recon.compare.watch import watch
from tests.recon import logs as L


def test_the_report_follows_a_running_run(tmp_path):
    logdir, html = tmp_path / "logs", tmp_path / "report.html"
    meta = {"harness": "synth", "group_id": "g"}
    arrivals = iter([lambda: L.episode(logdir, "ok-1", L.two_tool_turns, reward=1.0, metadata=meta),
                     lambda: L.episode(logdir, "ok-2", L.two_tool_turns, reward=0.0, metadata=meta)])
    lines, reports, pages = [], [], []

    def build():
        reports.append(run_compare([str(logdir)], [], [], html_path=str(html)))
        return reports[-1]

    def between_rounds(seconds):  # the run goes on between two rounds: one more episode lands
        assert seconds == 2.0
        if html.exists():
            pages.append(html.read_text())
        next(arrivals)()

    logdir.mkdir()
    assert watch(build, html, 2.0, echo=lines.append, rounds=3, sleep=between_rounds) == 0
    assert "no report yet" in lines[0], lines  # nothing logged yet: said, and the watch goes on
    assert [r["harnesses"]["synth"]["episodes"]["logs"] for r in reports[-2:]] == [1, 2]
    assert "wrote" in lines[1] and "1 episode logs" in lines[1] and "2 episode logs" in lines[2]
    page = html.read_text()
    assert "<meta http-equiv='refresh' content='2'>" in page and page.count("http-equiv='refresh'") == 1
    assert pages and "http-equiv='refresh'" in pages[0]


def test_watch_needs_an_html_page(tmp_path):
    r = CliRunner().invoke(main, ["compare", str(tmp_path), "--watch", "5"])
    assert r.exit_code == 2 and "--watch rewrites the --html page" in r.output
