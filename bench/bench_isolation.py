"""What the sandboxes cost: sandbox start time and per-call latency through the model API forwarders.

    .venv/bin/python bench/bench_isolation.py                       # 1 and 64 concurrent episodes
    .venv/bin/python bench/bench_isolation.py --concurrency 1 8 --calls 10 --no-docker

For each runtime (local unisolated = the baseline, local + bubblewrap, docker) and each concurrency,
N episodes at once each: prepare a sandbox with an upstream (a minimal HTTP server on 127.0.0.1
standing in for the episode's proxy, so only the path is measured), then run, the way the
scheduler runs a harness (behind the inner forwarder when isolated), a Python client that makes
`--calls` HTTP calls, each on a new connection, to the base URL the harness would be given.

- start: prepare (workspace copy, the API socket, the container) + the first command's start
  (bubblewrap / docker exec, the inner forwarder), until the client's first line;
- call: the median per-call round trip seen inside (unisolated: straight to the upstream;
  isolated: inner forwarder -> Unix socket -> host pipe -> upstream).
Ratios are against local unisolated in the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent

from harness_recipes.runtimes import make_runtime  # noqa: E402
from harness_recipes.tasks.task_file import Task  # noqa: E402

CLIENT = r'''
import http.client, json, sys, time, urllib.parse
print("up", flush=True)
u = urllib.parse.urlsplit(sys.argv[1])
times = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter()
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    c.request("POST", "/v1/chat/completions", body=b"{}", headers={"Content-Type": "application/json"})
    assert c.getresponse().read() == b"ok"
    c.close()
    times.append(time.perf_counter() - t0)
print(json.dumps(times))
'''
REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


async def upstream() -> tuple[asyncio.AbstractServer, str]:
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(REPLY)
        await writer.drain()
        writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def episode(rt, i: int, url: str, calls: int, tag: str) -> tuple[float, float]:
    t0 = time.perf_counter()
    sb = await rt.prepare(Task(id="b", prompt="p", eval_cmd="true"), f"bench-{tag}-{i}.s0", Path("/usr/bin/python3"),
                          upstream=url)
    try:
        argv = sb.harness_argv([sb.python, "-c", CLIENT, sb.api_base(url), str(calls)])
        res = await sb.exec(argv, {"PATH": "/usr/bin:/bin"}, timeout=600)
        if res.rc != 0:
            raise RuntimeError(f"{tag}: client failed: {res.stderr.decode(errors='replace')[-800:]}")
        times = json.loads(res.stdout.decode().splitlines()[-1])
        # the start ends at the client's first call: the run's own time minus the calls
        start = time.perf_counter() - t0 - sum(times)
        return start, statistics.median(times)
    finally:
        await sb.close()


async def measure(runtime: str, opts: dict, n: int, calls: int, workdir: str) -> dict:
    server, url = await upstream()
    rt = make_runtime(runtime, workdir=workdir, **opts)
    try:
        tag = f"{runtime}-{opts.get('isolation', 'docker')}-{n}"
        res = await asyncio.gather(*(episode(rt, i, url, calls, tag) for i in range(n)))
    finally:
        await rt.shutdown()
        server.close()
    starts, lat = [r[0] for r in res], [r[1] for r in res]
    return {"start_median_s": statistics.median(starts), "start_max_s": max(starts),
            "call_median_ms": 1000 * statistics.median(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--calls", type=int, default=20, help="HTTP calls per episode")
    ap.add_argument("--no-docker", action="store_true")
    ap.add_argument("--out", default=str(BENCH / "results" / "isolation.json"))
    a = ap.parse_args()
    cases = [("local none", "local", {"isolation": "none"}), ("local bubblewrap", "local", {"isolation": "bwrap"})]
    if not a.no_docker:
        cases.append(("docker", "docker", {"memory": "256m", "cpus": 0.5}))
    rows = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-iso-") as work:
        for n in a.concurrency:
            base = None
            for label, runtime, opts in cases:
                r = asyncio.run(measure(runtime, opts, n, a.calls, work))
                base = base or r
                r.update(case=label, concurrency=n, start_ratio=r["start_median_s"] / base["start_median_s"],
                         call_ratio=r["call_median_ms"] / base["call_median_ms"])
                rows.append(r)
                print(f"{label:17s} x{n:<3d} start {r['start_median_s']:.3f}s (max {r['start_max_s']:.3f}) "
                      f"{r['start_ratio']:.2f}x   call {r['call_median_ms']:.2f} ms {r['call_ratio']:.2f}x", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"calls": a.calls, "rows": rows}, indent=1))
    print("\n| episodes at once | runtime | start (median) | vs unisolated | per-call (median) | vs unisolated |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['case']} | {r['start_median_s']:.3f} s | {r['start_ratio']:.2f}x | "
              f"{r['call_median_ms']:.2f} ms | {r['call_ratio']:.2f}x |")


if __name__ == "__main__":
    main()
