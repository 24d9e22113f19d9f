"""bench/gpu_is_ratio.py (prepared for a GPU machine) runs: here on the CPU with the server in bf16, the
trainer in fp32, a small batch. The new rule leaves no token at -inf and no sequence zeroed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_script_runs_on_cpu_in_bf16(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_is_ratio.py"), "--device", "cpu", "--dtype",
                           "bf16", "--seqs", "8", "--tokens", "24", "--threads", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_is_ratio.json").read_text())
    assert res["device"] == "cpu" and res["server_dtype"] == "bf16" and res["transform"].startswith("T=0.6 top_k=20")
    after, before = res["after"], res["before"]
    assert after["masked_token_share"] == 0.0 and after["seq_zeroed_share"] == 0.0 and after["seq_ratio_min"] > 0.1
    assert before["kept_set_fix_share"] == 0.0 and after["kept_set_fix_share"] == before["masked_token_share"]
    assert 0.5 < after["seq_ratio_mean"] < 2.0
    # the default mode (token_truncate) gives no token weight 0 when none is -inf
    assert after["lost_token_share"]["token_truncate"] == 0.0 and set(after["lost_token_share"]) == {
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}
    cut = res["after_server_dtype_cut"]  # the cuts on bf16-rounded trainer logits (--server_logits_dtype)
    assert cut["masked_token_share"] == 0.0 and cut["lost_token_share"]["token_truncate"] == 0.0
