"""`polar-recon build` when the user gets it wrong or stops it: no logs, swapped arguments, a
truncated log, Ctrl-C."""
from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

import polar_recon.cli as cli

from . import logs as L


def run(*args):
    r = CliRunner().invoke(cli.main, [str(a) for a in args])
    return r.exit_code, r.output


def one_group(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for k in range(2):
        L.episode(d, f"ep{k}", lambda c: L.two_tool_turns(c, reasoning=("Write it.", "Check it.")), reward=float(k),
                  metadata={"group_id": "t1"}, harness="tidy", seed=k)


def test_a_directory_without_logs_is_an_error_not_built_0(tmp_path):
    (tmp_path / "empty").mkdir()
    code, text = run("build", tmp_path / "empty", tmp_path / "out")
    assert code == 1 and "no capture logs (*.arrow) in" in text and "polar_logdir" in text, text
    assert "built 0" not in text and not list((tmp_path / "out").glob("shard-*"))


def test_swapped_arguments_are_named(tmp_path):
    logs, out = tmp_path / "logs", tmp_path / "out"
    one_group(logs)
    code, text = run("build", logs, out)
    assert code == 0 and "built 2 episodes" in text, text
    code, text = run("build", out, logs)  # OUT LOGDIR
    assert code == 2 and "holds shards, not capture logs" in text and "swapped" in text, text
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    code, text = run("build", fresh, logs)  # an empty LOGDIR, logs where OUT goes
    assert code == 1 and "swapped arguments?" in text, text


def test_a_truncated_log_is_reported_corrupt(tmp_path):
    logs = tmp_path / "logs"
    one_group(logs)
    data = (logs / "ep1.arrow").read_bytes()
    (logs / "ep1.arrow").write_bytes(data[: len(data) * 2 // 3])  # a copy cut short
    code, text = run("build", logs, tmp_path / "out")
    assert "corrupt, not finished: cut mid-record" in text and "ep1" in text.split("corrupt, not finished")[1], text
    assert "not finished, skipped" not in text


def test_ctrl_c_in_build_exits_130(tmp_path, monkeypatch):
    logs = tmp_path / "logs"
    one_group(logs)

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_shards", interrupted)
    code, text = run("build", logs, tmp_path / "out")
    assert code == 130 and "interrupted" in text, text
