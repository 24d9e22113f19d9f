"""The quick starts run as written: README.md's "Five minutes with your harness and server" and
docs/rollout.md's "Running on one machine", from a fresh temporary directory, failing when a
documented command fails.

The blocks marked ``<!-- run: tests/docs/test_quickstarts.py -->`` (tests/docs/fenced.py) are
joined, in order, into one bash script run with ``set -euo pipefail``; what a block starts in the
background (``&``) is stopped when the script ends. The only changes made to the text, all here:

- ``<id>`` -> ``quickstart-1`` and ``MODEL_DIR`` -> ``tiny-qwen3``: the placeholders the reader fills in;
- ``FILE`` -> the running proxy's control-secret file (docs/rollout.md, whose proxy the test starts,
  as that page says one must be running), and its synopsis's optional ``[--...]`` parts left out;
- the ports 8000 / 8080 / 8081 -> free ones (other processes on this machine may hold those);
- ``--samples 4`` -> ``--samples 2`` and ``--num_generations 4`` -> ``--num_generations 2``: three groups
  of two show that the commands work (the training step takes two of them); twelve episodes only cost time.

The temporary directory stands for the checkout the docs are run from: ``data/`` in it is a link
to the repository's, the commands are the installed ones (this environment's ``bin/`` first on PATH).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import polars as pl

from harness_recipes.node.local_stack import capture_proxy, serve
from tests.support.servers import tiny_model_dir
from trainer.cpu_fallback import accelerator_present

from .fenced import REPO, marked_for

SELF = "tests/docs/test_quickstarts.py"
README, ROLLOUT = "README.md", "docs/rollout.md"
PLACEHOLDERS = {"<id>": "quickstart-1", "MODEL_DIR": "tiny-qwen3"}
SCALE = {"--samples 4": "--samples 2", "--num_generations 4": "--num_generations 2"}
PREAMBLE = """set -euo pipefail
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true' EXIT
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(blocks, ports: dict[int, int], extra: dict[str, str] | None = None, synopsis: bool = False) -> str:
    text = "\n".join(b.text for b in blocks)
    for k, v in {**PLACEHOLDERS, **SCALE, **(extra or {})}.items():
        text = text.replace(k, v)
    if synopsis:  # a synopsis's optional parts, [--runtime local|docker] ... (never JSON's brackets)
        text = re.sub(r" *\[--[^\]\n]*\]", "", text)
    for old, new in ports.items():
        text = re.sub(rf"\b{old}\b", str(new), text)
    return PREAMBLE + text


def run_script(text: str, cwd: Path, timeout: float = 1500) -> subprocess.CompletedProcess:
    (cwd / "data").symlink_to(REPO / "data")
    (cwd / "quickstart.sh").write_text(text)
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(["bash", "quickstart.sh"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the quick start did not finish in {timeout:.0f} s:\n{out[-6000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the script's trap missed
        except ProcessLookupError:
            pass
    (cwd / "quickstart.log").write_text(out)  # the whole output, for a failure's reader
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def episodes(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]


def test_readme_five_minutes(tmp_path):
    blocks = marked_for(SELF, README, "Five minutes with your harness and server")
    assert len(blocks) >= 3, "the README's quick start has lost its run markers"
    res = run_script(script(blocks, {8000: free_port(), 8080: free_port(), 8081: free_port()}), tmp_path)
    assert res.returncode == 0, res.stdout[-8000:]
    # capture -> shards -> report, by hand
    shards = pl.read_parquet(sorted((tmp_path / "out").glob("shard-*.parquet")))
    assert shards["episode_id"].unique().to_list() == ["quickstart-1"] and shards["reward"][0] == 1.0
    assert (tmp_path / "report.html").stat().st_size > 10_000
    # the rollout: every episode solved by the scripted server but fix-max's second sample (the script
    # has it only read the file, so that group's rewards differ), its shards and report in its own OUT
    recs = episodes(tmp_path / "rollout-out")
    assert len(recs) == 6 and {r["status"] for r in recs} == {"done"}, recs
    assert {r["episode_id"]: r["reward"] for r in recs if r["reward"] != 1.0} == {"fix-max.s1": 0.0}, recs
    assert list((tmp_path / "rollout-out").glob("shard-*.parquet")) and (tmp_path / "rollout-out" / "report.html").exists()
    # the training step on the rollout's shards, on the CPU, its weights loaded by the server through the proxy
    assert "polar-train: no GPU found: training on the CPU in fp32" in res.stdout or accelerator_present(), res.stdout[-4000:]
    assert (tmp_path / "ckpt" / "model.safetensors").is_file(), res.stdout[-4000:]
    versions = pl.read_parquet(sorted((tmp_path / "rollout-out").glob("shard-*.parquet")))["weight_version"]
    assert len(set(versions.to_list())) == 1, versions  # all sampled by the server's first weights
    # the step's weights, saved and synced: polar-train fails unless the proxy answers their version
    assert (tmp_path / "ckpt" / "polar-weights" / "step-000001" / "model.safetensors").is_file()


def test_rollout_md_quick_start(tmp_path):
    """docs/rollout.md's block, against the running proxy it asks for (a secured capture proxy in
    front of the scripted polar-serve, logging to ./logs)."""
    blocks = marked_for(SELF, ROLLOUT, "Running on one machine")
    assert blocks, "docs/rollout.md's quick start has lost its run marker"
    with serve(tiny_model_dir(), script=REPO / "data" / "tasks" / "scripts" / "fix_tasks.json") as srv, \
            capture_proxy(srv.url, tmp_path / "logs") as proxy:
        text = script(blocks, {8080: proxy.port}, {"FILE": str(proxy.secret_file)}, synopsis=True)
        res = run_script(text, tmp_path)
    assert res.returncode == 0, res.stdout[-8000:]
    recs = episodes(tmp_path / "out")
    assert len(recs) == 6 and {r["status"] for r in recs} == {"done"}, recs
    assert {r["episode_id"]: r["reward"] for r in recs if r["reward"] != 1.0} == {"fix-max.s1": 0.0}, recs
    assert list((tmp_path / "out").glob("shard-*.parquet"))
