"""The benchmark script runs (a tiny size): synthetic logs are built without error, every episode
lands, and the numbers the README quotes are produced."""
import json
import subprocess
import sys

from .logs import REPO


def test_bench_quick_run():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_recon.py"), "--episodes", "4", "--calls", "6",
                        "--max-prompt", "3000", "--json"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    b = res["build"]
    assert b["episodes"] == 4 and b["errors"] == 0 and b["sequences"] == 4
    # one sequence per episode: the first prompt (2000), every sampled completion (150 each, the
    # re-rendered ones included whole) and each tool turn's context (50 ids + 9 turn markers)
    assert b["sequence_tokens"] == 4 * (2000 + 6 * 150 + 5 * (50 + 9))
    assert b["trainable_tokens"] == 4 * 6 * 150
    # the ledger: every sampled completion token trained (the synthetic calls are all usable)
    assert b["ledger"]["sampled"] == b["ledger"]["trained"] == b["trainable_tokens"]
    assert b["ledger"]["excluded"] == {} and "100.0% accounted for, 100.0% trained" in b["ledger_summary"]
    assert res["read_floor"]["rows"] == 4 * 7 and res["build_over_floor"] > 0
