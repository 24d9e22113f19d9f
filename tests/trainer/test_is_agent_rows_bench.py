"""bench/bench_is_agent_rows.py runs, small: on realistic logits at 8,192-token rows with 0.03 logit
noise and bf16 rounding, the default mode loses no token, and its mean log ratio is the mismatch's own (-KL,
as with the server's kept set; docs/benchmarks/trainer.md has the full run), while TRL's handling (full-
softmax pi_old, sequence_mask) gives every row weight 0."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_agent_rows_bench_default_meets_the_bar(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_is_agent_rows.py"), "--positions", "1024",
                           "--vocab", "2048", "--rows", "8", "--lengths", "8192", "--conditions", "noise 0.03 + bf16",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())["conditions"]["noise 0.03 + bf16"]
    assert res["token_level"]["polar_minus_inf_share"] == 0.0
    assert res["token_level"]["logit_gap_max"] < 0.2  # within LOGIT_TOL (trainer/behaviour_logprobs.py)
    rows = res["lengths"]["8192"]
    default = rows["polar token_truncate 3"]
    # The mean log ratio per token is -KL(mu || pi_old), the mismatch itself, with a wide draw spread on a
    # draw this small (-4.0e-4 over the benchmark's 16,384 positions, -0.7e-3 to -2.7e-3 over 1,024-4,096).
    # What the trainer adds to it is what its pi_old (its kept set plus the re-added token) differs from
    # the one over the server's own kept set: that must stay small.
    mask_ref = rows["polar token_truncate 3 (server's mask)"]
    assert default["lost_share"] == 0.0 and abs(default["mean_log_ratio_per_token"]) < 5e-3
    assert abs(default["mean_log_ratio_per_token"] - mask_ref["mean_log_ratio_per_token"]) < 5e-4
    assert abs(default["weight_mean"] - 1) < 5e-3
    assert 0.95 < default["weight_p5"] <= default["weight_p95"] < 1.05
    assert rows["TRL 1.16 (sequence_mask 3)"]["weight_mean"] < 1e-3  # the kept mass, multiplied over the row
    assert rows["verl token TIS (<= 2)"]["mean_log_ratio_per_token"] < -0.005  # full softmax: the kept-mass bias
