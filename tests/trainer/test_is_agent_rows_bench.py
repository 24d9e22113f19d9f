"""bench/bench_is_agent_rows.py, small and deterministic (fixed seeds): on realistic logits at 8,192-token
rows with 0.03 logit noise and bf16 rounding (Qwen3's sampling), the default mode loses no token and its
mean log ratio is the mismatch's own -KL(mu || pi_S) plus what polar's pi_old adds, which stays under the
bar (|mean log ratio + KL| < 1e-3) with a standard error well below it; TRL's handling (full-softmax
pi_old, sequence_mask) gives every row weight 0. And the bar can fail: under min_p with a bf16 server, an
fp32 trainer cutting on its own logits adds -2e-3 per token, which cutting on bf16-rounded logits removes
(docs/benchmarks/trainer.md has the full runs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench(tmp_path, *args: str) -> tuple[int, dict, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "res.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_is_agent_rows.py"), *args, "--check",
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 1) and out.exists(), proc.stderr[-3000:]
    return proc.returncode, json.loads(out.read_text())["conditions"], proc.stdout


def test_agent_rows_bench_default_meets_the_bar(tmp_path):
    rc, conds, stdout = bench(tmp_path, "--positions", "4096", "--vocab", "8192", "--rows", "8", "--lengths", "8192",
                              "--conditions", "noise 0.03 + bf16")
    res = conds["noise 0.03 + bf16"]
    print(stdout.splitlines()[-1])  # the raw mean log ratio, -KL and the added bias (pytest -s shows it)
    assert rc == 0 and "criterion, noise 0.03 + bf16: mean log ratio" in stdout and stdout.rstrip().endswith("PASS")
    e, k = res["expectation"], res["criterion"]
    # The bar, with a standard error (over 4,096 positions, exact per position) far below it.
    assert k["pass"] and abs(k["added_bias"]) < 1e-3 and k["added_bias_se"] < 1e-4 and k["lost_share"] < 0.01
    assert k["lost_at"] == 8192 and e["lost_mass"]["mean"] == 0.0
    # The identity the bar rests on: the mean log ratio is -KL plus what polar adds, each measured apart.
    assert abs(e["mean_log_ratio"]["mean"] - (e["added_bias"]["mean"] - e["kl"]["mean"])) < 1e-9
    assert 1e-4 < e["kl"]["mean"] < 1e-3 and e["kl"]["se"] < 1e-4  # this mismatch's own KL: real, and small
    assert abs(e["bias_sets_agree"]["mean"]) < 1e-6  # where the kept sets agree polar adds nothing
    assert e["lost_mass_without_readd"]["mean"] > 0  # the re-add at the cut is what keeps every token
    assert res["token_level"]["logit_gap_max"] < 0.2  # within LOGIT_TOL (trainer/behaviour_logprobs.py)
    default = res["lengths"]["8192"]["polar token_truncate 3"]
    assert default["lost_share"] == 0.0 and abs(default["weight_mean"] - 1) < 5e-3
    assert 0.95 < default["weight_p5"] <= default["weight_p95"] < 1.05
    # The sampled per-token mean (one token per position) has a spread of its own, which is why the bar is
    # checked on the exact per-position expectations.
    assert e["sampled_mean_log_ratio_se"] > 3 * e["added_bias"]["se"]
    # The peers: a full-softmax pi_old adds the kept mass (far beyond the bar), and TRL's sequence_mask on it
    # weighs every row (almost) 0.
    assert e["full_softmax_bias"]["mean"] < -0.01
    assert res["lengths"]["8192"]["TRL 1.16 (sequence_mask 3)"]["weight_mean"] < 1e-3


def test_agent_rows_bar_fails_on_a_biased_cut_and_the_servers_precision_fixes_it(tmp_path):
    rc, conds, stdout = bench(tmp_path, "--positions", "2048", "--vocab", "4096", "--lengths",
                              "--conditions", "bf16", "--sampling", "1.0,-1,1,0.05")
    e, k = conds["bf16"]["expectation"], conds["bf16"]["criterion"]
    assert rc == 1 and not k["pass"] and stdout.rstrip().endswith("FAIL")
    assert k["added_bias"] < -1e-3 and k["added_bias_se"] < 5e-4  # the fp32 cut on the trainer's logits
    assert e["bias_trainer_keeps_more"]["mean"] < -1e-3  # one way: min_p's threshold sits on the bf16 grid
    assert abs(e["added_bias_bf16_cut"]["mean"]) < 1e-6 and e["lost_mass_bf16_cut"]["mean"] == 0.0
