"""Several capture proxies per node (harness_recipes/node/proxies.py): K=1 vs K=2 side by side at 64, 256
and 512 concurrent streaming episodes, each episode's calls sent to its proxy by its id.

    .venv/bin/python bench/bench_proxies.py                 # the issue's counts (several minutes)
    .venv/bin/python bench/bench_proxies.py --quick         # small counts, a smoke check
    .venv/bin/python bench/bench_proxies.py --json OUT.json

Backend: bench/fake_backend.py with vLLM's shapes and ids (streams of --chunks chunks --gap-ms apart,
the first after --first-ms), so the proxies, not a model, are what is measured. Each concurrency
level runs K=1 then K=2, then K=2 then K=1 (the order alternates: this machine is shared, and load
drifts). Per run: calls/s, errors, p50/p99 call latency, and a check of every episode's log: all
its calls there, only its own (0 mixed rows). Each episode is one client making --calls streamed
calls back to back, then its end. The load generator runs in this process: on a 2-core machine it
competes with the proxies for the cores, which the report states next to the numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from harness_recipes.node.processes import free_port, running
from harness_recipes.node.proxies import proxy_pool
from polar_contracts.log.reader import read_episode

BENCH = Path(__file__).resolve().parent


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def body(eid: str, i: int) -> bytes:
    return json.dumps({"model": "fake", "stream": True, "max_tokens": 60,
                       "messages": [{"role": "user", "content": f"episode {eid} call {i}"}]}).encode()


async def episode(session, url, eid, calls) -> tuple[list[float], int]:
    lat, errs = [], 0
    for i in range(calls):
        t0 = time.perf_counter()
        try:
            async with session.post(f"{url}/polar/{eid}/v1/chat/completions", data=body(eid, i),
                                    headers={"content-type": "application/json"}) as r:
                tail = b""
                async for chunk in r.content.iter_any():
                    tail = (tail + chunk)[-32:]
                ok = r.status == 200 and tail.endswith(b"data: [DONE]\n\n")
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        if ok:
            lat.append(time.perf_counter() - t0)
        errs += not ok
    try:
        async with session.post(f"{url}/polar/{eid}/end", json={"reward": 1.0}) as r:
            errs += r.status != 200
    except (TimeoutError, aiohttp.ClientError):
        errs += 1
    return lat, errs


async def load(pool, eids, calls) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(episode(s, pool.for_episode(e), e, calls) for e in eids))
        dt = time.perf_counter() - t0
    lat = [x for ls, _ in res for x in ls]
    return {"calls_per_s": len(eids) * calls / dt, "seconds": dt, "errors": sum(e for _, e in res),
            "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


def check_logs(logdir: Path, eids, calls) -> dict:
    """Each episode's log: every call there, only its own (a second writer or a misrouted call shows)."""
    missing = mixed = 0
    for e in eids:
        log = read_episode(logdir / f"{e}.arrow")
        rows = log.calls.to_dicts()
        missing += (sorted(r["call_index"] for r in rows) != list(range(calls))) or not log.finished
        mixed += sum(r["episode_id"] != e or f"episode {e} call {r['call_index']}" not in r["request"] for r in rows)
    return {"incomplete_logs": missing, "mixed_rows": mixed}


def run_one(upstream, work: Path, k: int, conc: int, calls: int, tag: str) -> dict:
    logdir = work / f"logs-{tag}"
    with proxy_pool(upstream, logdir, k, workdir=work / f"proxies-{tag}", sets={"polar_dialect": "vllm"}) as pool:
        eids = [f"b{tag}-{i}" for i in range(conc)]
        out = asyncio.run(load(pool, eids, calls))
    out.update(check_logs(logdir, eids, calls), k=k, streams=conc)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--streams", default="64,256,512", help="concurrent episodes per level, comma-separated")
    ap.add_argument("--calls", type=int, default=4, help="streamed calls per episode")
    ap.add_argument("--chunks", type=int, default=60)
    ap.add_argument("--gap-ms", type=float, default=5)
    ap.add_argument("--first-ms", type=float, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    levels = [16, 32] if args.quick else [int(x) for x in args.streams.split(",")]
    calls = 2 if args.quick else args.calls
    work = Path(tempfile.mkdtemp(prefix="bench-proxies-"))
    port = free_port()
    cmd = [sys.executable, str(BENCH / "fake_backend.py"), "--port", str(port), "--dialect", "vllm",
           "--chunks", str(args.chunks), "--gap-ms", str(args.gap_ms), "--first-ms", str(args.first_ms)]
    results = []
    with running(cmd, log=work / "fake.log", port=port, timeout=30) as backend:
        for n, conc in enumerate(levels):
            order = (1, 2) if n % 2 == 0 else (2, 1)
            for rep, k in enumerate(order + order[::-1]):
                r = run_one(backend.url, work, k, conc, calls, f"c{conc}-k{k}-{rep}")
                results.append(r)
                print(json.dumps(r), flush=True)
    rows = []
    for conc in levels:
        per = {k: [r for r in results if r["streams"] == conc and r["k"] == k] for k in (1, 2)}
        cps = {k: statistics.median(r["calls_per_s"] for r in per[k]) for k in (1, 2)}
        p50 = {k: statistics.median(r["p50_ms"] for r in per[k]) for k in (1, 2)}
        errs = {k: sum(r["errors"] for r in per[k]) for k in (1, 2)}
        mixed = {k: sum(r["mixed_rows"] + r["incomplete_logs"] for r in per[k]) for k in (1, 2)}
        rows.append((conc, cps, p50, errs, mixed))
    print(f"\nbench_proxies: {calls} streamed calls per episode, {args.chunks} chunks {args.gap_ms:g} ms apart; "
          f"{os.cpu_count()} cores (load generator in the same machine)\n")
    print("| streams | K=1 calls/s | K=2 calls/s | K=2 / K=1 | p50 ms K=1 | p50 ms K=2 | errors K=1/K=2 | "
          "mixed or incomplete K=1/K=2 |")
    print("|---|---|---|---|---|---|---|---|")
    for conc, cps, p50, errs, mixed in rows:
        print(f"| {conc} | {cps[1]:.1f} | {cps[2]:.1f} | {cps[2] / cps[1]:.2f}x | {p50[1]:.0f} | {p50[2]:.0f} | "
              f"{errs[1]}/{errs[2]} | {mixed[1]}/{mixed[2]} |")
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "levels": levels, "calls": calls}, indent=1))
    bad = sum(r["errors"] + r["mixed_rows"] + r["incomplete_logs"] for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
