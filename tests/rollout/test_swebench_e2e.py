"""One SWE-bench instance end to end: the real Codex CLI in the instance's image, through mitmdump + the
Polar addon + polar-serve (scripted), graded by swebench's own parser and report, into shards.

`polar-rollout run --recipe codex --tasks swebench:data/swebench/mini.jsonl --instances ID --runtime docker`:
the image is built here (Debian base by debootstrap, cached in $POLAR_CACHE), Codex fixes the
planted bug in /testbed, the eval script applies test_patch and runs the tests, swebench says
resolved -> reward 1.0, and the per-test results land in the end metadata and the shards.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.recipes.install import ensure_installed
from harness_recipes.recipes.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data" / "swebench"
INSTANCE = "jpvanhal__inflection-ordinal-thirteen"


def test_codex_solves_a_swebench_instance_in_its_image(docker_runtime_cls, tmp_path):
    from tests.support.servers import tiny_model_dir
    ensure_installed(load_recipe("codex"))
    logdir, out = tmp_path / "logs", tmp_path / "out"
    with serve(tiny_model_dir(), script=DATA / "scripts" / "mini.json") as srv, capture_proxy(srv.url, logdir) as proxy:
        proc = subprocess.run(
            [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", "codex",
             "--tasks", f"swebench:{DATA / 'mini.jsonl'}", "--instances", INSTANCE, "--runtime", "docker",
             "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir),
             "--out", str(out), "--no-progress"],
            cwd=ROOT, capture_output=True, text=True, timeout=900)
        proxy_out = proxy.output()[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    brief = {k: v for k, v in rec.items() if k != "swebench"}  # its PASS_TO_PASS list is 441 names long
    detail = f"{brief}\nproxy output:\n{proxy_out}"
    assert rec["status"] == "done" and rec["harness_rc"] == 0 and rec["runtime"] == "docker", detail
    # (the agent's own test run leaves __pycache__ files too)
    assert "inflection/__init__.py" in rec["changed_files"], detail
    sb = rec["swebench"]
    assert rec["reward"] == 1.0 and sb["resolved"] is True, f"{detail}\n{sb.get('error')}"
    f2p = json.loads((DATA / "mini.jsonl").read_text().splitlines()[1])["FAIL_TO_PASS"]
    assert sorted(sb["tests"]["FAIL_TO_PASS"]["success"]) == sorted(f2p) and not sb["tests"]["FAIL_TO_PASS"]["failure"]
    assert len(sb["tests"]["PASS_TO_PASS"]["success"]) == 441 and not sb["tests"]["PASS_TO_PASS"]["failure"]
    # swebench's own report and the test log it was read from are kept with the episode.
    edir = out / "rollout" / rec["episode_id"]
    report = json.loads((edir / "report.json").read_text())
    assert report["resolved"] is True and "Start Test Output" in (edir / "test_output.txt").read_text()
    assert "number % 100 in (11, 12, 13)" in (edir / "model.patch").read_text()

    from polar_contracts.log.reader import read_episode
    log = read_episode(logdir / f"{rec['episode_id']}.arrow")
    assert log.finished and log.reward == 1.0 and log.metadata["discard"] is False
    assert log.metadata["eval"]["resolved"] is True and log.metadata["eval"]["instance_id"] == INSTANCE
    calls = log.calls.filter(~log.calls["auxiliary"].fill_null(False))
    assert calls.height >= 3, f"expected fix, test and final-answer calls, got {calls.height}"
    for row in calls.iter_rows(named=True):
        assert row["error"] is None and row["prompt_ids"] and row["completion_ids"]

    import polars as pl
    df = pl.read_parquet(out / "shard-*.parquet").filter(pl.col("episode_id") == rec["episode_id"])
    assert df.height >= 1 and (df["reward"] == 1.0).all()
    # the per-test results reach the shards: the "eval" column, swebench's lists as graded
    for row in df.iter_rows(named=True):
        ev = json.loads(row["eval"])
        assert ev["kind"] == "swebench" and ev["resolved"] is True
        assert sorted(ev["tests"]["FAIL_TO_PASS"]["success"]) == sorted(f2p)
