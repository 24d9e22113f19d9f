"""N concurrent bubblewrap episodes, one of them a bomb: do the others finish, and how much slower?

Each honest episode calls its model API (a host HTTP server standing in for the capture proxy,
reached through the episode's API socket like a harness's calls) six times with a little CPU work
between the calls, then writes a file. Each round runs them alone, then beside one bomb (a fork
bomb, a memory bomb, a disk filler), side by side in the same run, with small limits (256 MiB,
64 processes, 64 MiB disk, 1 CPU). Needs root (cgroups) and bubblewrap.

    PYTHONPATH=. .venv/bin/python bench/bench_sandboxes.py --episodes 8 --rounds 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from tempfile import TemporaryDirectory

from harness_recipes.recipes.limits import Limits
from harness_recipes.runtimes import make_runtime
from harness_recipes.tasks.task_file import Task

ROOT = Path(__file__).resolve().parents[1]
LIMITS = Limits(memory=256 << 20, pids=64, cpus=1.0, disk=64 << 20, disk_poll=0.2)
BOMBS = {
    "fork bomb": "bash -c 'b(){ b | b & }; b; sleep 60'",
    "memory bomb": "python3 -c 'b=[]\nfor _ in range(128): b.append(bytearray(16<<20))\nimport time; time.sleep(60)'",
    "disk filler": "for i in $(seq 40); do head -c 8M /dev/zero > fill$i || exit 3; sleep 0.05; done; sleep 60",
}
HONEST = r'''
import json, sys, time, urllib.request
t0 = time.monotonic()
for i in range(6):
    with urllib.request.urlopen(sys.argv[1] + "/ping", timeout=30) as r:
        r.read()
    sum(x * x for x in range(200000))
    time.sleep(0.3)
open("done.txt", "w").write("ok")
print(json.dumps({"seconds": time.monotonic() - t0}))
'''
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}


def proxy() -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


async def round_(rt, url: str, n: int, bomb: str | None) -> tuple[list[float], int, str]:
    task = Task(id="bench", prompt="p", eval_cmd="true", workspace_dir=ROOT / "data/tasks/repos/fix_add")
    boxes = [await rt.prepare(task, f"h{i}.s0", Path("/usr/bin/python3"), upstream=url) for i in range(n)]
    bad = await rt.prepare(task, "bomb.s0", Path("/usr/bin/python3")) if bomb else None
    try:
        runs = [sb.exec(sb.harness_argv([sb.python, "-c", HONEST, sb.api_base(url)]), {**ENV, "HOME": sb.home},
                        timeout=120) for sb in boxes]
        if bad is not None:
            runs.append(bad.exec(["sh", "-c", BOMBS[bomb]], {**ENV, "HOME": bad.home}, timeout=60))
        res = await asyncio.gather(*runs)
        ok = [r for r in res[:n] if r.rc == 0 and not r.limit]
        secs = [json.loads(r.stdout.decode().splitlines()[-1])["seconds"] for r in ok]
        return secs, n - len(ok), res[n].limit if bad is not None else ""
    finally:
        for sb in [*boxes, *([bad] if bad else [])]:
            await sb.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=8, help="honest episodes at once")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    srv = proxy()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    print(f"{args.episodes} honest bubblewrap episodes, limits {LIMITS.describe()}, {args.rounds} round(s)")
    print("| beside them | honest finished | p50 s | max s | baseline p50 s (same round) | the bomb's end |")
    print("|---|---|---|---|---|---|")
    with TemporaryDirectory(prefix="polar-bench-sandboxes-") as work:
        rt = make_runtime("local", isolation="bwrap", workdir=work, limits=LIMITS)
        try:
            for bomb in BOMBS:
                base, loud, failed, why = [], [], 0, ""
                for _ in range(args.rounds):
                    b, _, _ = asyncio.run(round_(rt, url, args.episodes, None))
                    t0 = time.monotonic()
                    s, f, why = asyncio.run(round_(rt, url, args.episodes, bomb))
                    base += b
                    loud += s
                    failed += f
                    why = f"{why} ({time.monotonic() - t0:.1f} s round)"
                done = args.episodes * args.rounds - failed
                print(f"| {bomb} | {done}/{args.episodes * args.rounds} | {statistics.median(loud):.2f} | "
                      f"{max(loud):.2f} | {statistics.median(base):.2f} | {why} |")
        finally:
            asyncio.run(rt.shutdown())
            srv.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
