"""bench/bench_scale.py runs end to end (docs/benchmarks/scale.md comes from it): a smoke run with
small counts, a quiet phase and one with the adversarial episode (bench/adversary.py), then one
proxy against bare mitmdump. No timing is asserted: what is checked is that the honest episodes had
no error and every call logged exactly once, and that every one of the adversary's requests was
refused (400 / 413 / 429), none answered otherwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_scale_quick(tmp_path):
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_scale.py"), "--quick", "--episodes", "12",
                        "--phases", "quiet,flood", "--stream-calls", "16", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    quiet, flood = res["scale"]
    for phase in (quiet, flood):
        assert phase["errors"] == phase["lost_rows"] == phase["duplicated_rows"] == phase["unfinished_logs"] == 0
    assert flood["adversary_errors"] == 0 and flood["adversary_connects"] > 0
    answered = {k.split()[0] for k in flood["adversary"]}
    assert answered == {"bomb", "nested"} and all(k.split()[1] in ("400", "413", "429") for k in flood["adversary"])
    assert {r["path"] for r in res["streams"]} == {"polar", "bare"} and not any(r["errors"] for r in res["streams"])
    assert "Part 1" in res["report"] and "Part 2" in res["report"]
