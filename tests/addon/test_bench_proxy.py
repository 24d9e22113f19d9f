"""bench/bench_proxy.py runs end to end (the README's proxy numbers come from it): a smoke run
with small counts. No timing is asserted here (timings belong to the benchmark's report); what is
checked is that every phase ran without errors through the addon, and the growing episode's log
size, a property of the log format, stays within the issue's 1.5x of its distinct tokens."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_proxy_quick(tmp_path):
    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "bench_proxy.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    polar = res["results"]
    assert polar["nonstream"]["polar"]["errors"] == 0 and polar["stream"]["polar"]["errors"] == 0
    assert polar["c64"]["polar"]["errors"] == 0 and polar["c256"]["polar"]["errors"] == 0
    assert polar["ns16"]["polar"]["errors"] == 0
    assert polar["log"]["calls"] > 0
    assert res["growing"]["ratio"] <= 1.5, res["growing"]
    # (bare+dispatch: bare mitmdump with the addon's fast dispatch; polar-stock: the addon with its mitmproxy
    # patches off, i.e. on stock mitmproxy)
    for path in ("bare+dispatch", "polar", "polar-stock"):
        assert polar["nonstream"][path]["errors"] == 0 and polar["ns16"][path]["errors"] == 0, path
    assert "median of paired differences" in r.stdout and "the addon's own share" in r.stdout
    assert "the capture on stock mitmproxy" in r.stdout
