"""1,024 concurrent streaming episodes on one node through K capture proxies, with and without one
adversarial episode, and one proxy process against bare mitmdump with streaming on, in one run.

    PYTHONPATH=. .venv/bin/python bench/bench_scale.py                       # 1,024 episodes, K=2
    PYTHONPATH=. .venv/bin/python bench/bench_scale.py --quick               # small counts, a smoke check
    PYTHONPATH=. .venv/bin/python bench/bench_scale.py --profile-dir DIR     # + cProfile of one proxy at 64 / 256

Upstream: bench/fake_backend.py (vLLM shapes with ids; streams of --chunks chunks --gap-ms apart, the
first after --first-ms), loopback only, so the proxies are what is measured.

Part 1, scale. K proxies (harness_recipes/node/proxies.py, with a control secret: episodes named by
capability, ended with the secret). --episodes honest episodes at once, each one client making
--calls streamed calls back to back, then its end. --phases: "quiet" (no adversary), "bodies" and
"flood": one more episode, routed to its proxy like any other, sends for the whole phase from its
own process (bench/adversary.py), concurrently:
  - gzip bombs: --bomb-mib MiB of ``{},{},...`` JSON with a repeated top-level key (16M objects at
    the default 45 MiB; a 45 KiB gzip body, under polar_max_body);
  - nested JSON: 100,000 levels of ``[``;
  - --flood idle connections held open, and ("flood" only) TCP connect/close in a loop.
"socket-flood" and "socket-flood-unpaced": the adversary as a sandbox really reaches out, through its
episode's model API Unix socket (harness_recipes/runtimes/api_socket.py, hosted in this process as
the node hosts it, claimed as the sandbox's forwarder claims it): connect, a request line, close, in
a loop; paced by the socket's per-episode connect budget, or (unpaced) with the budget lifted, as the
node was before it had one.
Its answers must be refusals (400, 413, 429); a 5xx or a dropped connection counts as an error.
Per phase: the honest episodes' errors, call latency and first-chunk p50/p99, every honest
episode's log read back (each call index exactly once, the end record there: lost or duplicated
rows counted), each proxy's peak RSS over its RSS before the phase (per proxy, and per episode it
served).

Part 2, one proxy process vs bare mitmdump with streaming on (bench/stream_on.py), --streams
concurrent streaming clients (64, 256) each making calls back to back with the real 79 KB Qwen
Code request, the two paths alternating (polar, bare, bare, polar): calls/s, first-chunk p50,
errors, peak RSS of each process. With --profile-dir the polar proxy of one extra round per level
runs under cProfile (its stats written to DIR/polar-<streams>.prof and summarised).

The load generator runs in this process: on a 2-core machine it competes with the proxies and the
fake backend for the cores. The report states the machine (cores, load average) next to the numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import multiprocessing
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

from bench.adversary import adversary_process, bomb_body, socket_flood_process
from bench.bench_proxy import Sampler, body_bytes, fake_backend, pct, proxy
from harness_recipes.node.local_stack import addon_script, venv_bin
from harness_recipes.node.processes import free_port, running
from harness_recipes.node.proxies import proxy_pool
from polar_contracts.control import capability
from polar_recon import read_episode

BENCH = Path(__file__).resolve().parent


def honest_body(eid: str, i: int) -> bytes:
    return json.dumps({"model": "fake", "stream": True, "max_tokens": 60,
                       "messages": [{"role": "user", "content": f"episode {eid} call {i}"}]}).encode()


async def stream_call(session, url: str, data: bytes, headers: dict) -> tuple[bool, float, float | None]:
    """(ok, seconds, seconds to the first body chunk) of one streamed call."""
    t0 = time.perf_counter()
    first = None
    try:
        async with session.post(url, data=data, headers=headers) as r:
            tail = b""
            async for chunk in r.content.iter_any():
                if first is None:
                    first = time.perf_counter() - t0
                tail = (tail + chunk)[-32:]
            ok = r.status == 200 and tail.endswith(b"data: [DONE]\n\n")
    except (TimeoutError, aiohttp.ClientError):
        ok = False
    return ok, time.perf_counter() - t0, first


async def honest_episode(session, pool, eid: str, calls: int) -> tuple[list, list, int]:
    url = pool.for_episode(eid) + f"/polar/{capability(pool.secret, eid)}/v1/chat/completions"
    lat, firsts, errs = [], [], 0
    for i in range(calls):
        ok, dt, first = await stream_call(session, url, honest_body(eid, i), {"content-type": "application/json"})
        if ok:
            lat.append(dt)
            firsts.append(first)
        errs += not ok
    try:
        async with session.post(pool.for_episode(eid) + f"/polar/{eid}/end", json={"reward": 1.0},
                                headers=pool.control_headers) as r:
            errs += r.status != 200
    except (TimeoutError, aiohttp.ClientError):
        errs += 1
    return lat, firsts, errs


def check_logs(logdir: Path, eids: list[str], calls: int) -> dict:
    """Every honest episode's calls logged exactly once, and its end record there."""
    lost = dup = unfinished = 0
    for e in eids:
        try:
            log = read_episode(logdir / f"{e}.arrow")
        except Exception:  # noqa: BLE001 - a missing or unreadable log: every call lost
            lost += calls
            unfinished += 1
            continue
        idx = [r["call_index"] for r in log.calls.to_dicts()
               if f"episode {e} call {r['call_index']}" in (r["request"] or "")]
        lost += len(set(range(calls)) - set(idx))
        dup += len(idx) - len(set(idx))
        unfinished += not log.finished
    return {"lost_rows": lost, "duplicated_rows": dup, "unfinished_logs": unfinished}


async def scale_phase(pool, procs, eids, calls, adversary: str | None, adversary_kind: str, args) -> dict:
    before = {i: p.memory_info().rss for i, p in enumerate(procs)}
    adv = api = None
    if adversary and adversary_kind.startswith("socket-flood"):
        from harness_recipes.runtimes.api_socket import CLAIM, MAGIC, ApiSocket, ConnectBudget
        budget = ConnectBudget(rate=1e12, burst=10**12) if adversary_kind.endswith("unpaced") else None
        api = await ApiSocket(pool.for_episode(adversary), budget=budget).start()
        r, w = await asyncio.open_unix_connection(str(api.path))  # claimed, as the forwarder does first
        w.write(MAGIC + CLAIM)
        assert await r.readline() == b"OK\n"
        w.close()
        mp = multiprocessing.get_context("spawn")
        stop, results = mp.Event(), mp.Queue()
        adv = mp.Process(target=socket_flood_process, args=(str(api.path), stop, results))
        adv.start()
        ready = await asyncio.to_thread(results.get, True, 300)
        assert ready == "ready", ready
        await asyncio.sleep(1.0)
    elif adversary:
        mp = multiprocessing.get_context("spawn")
        stop, results = mp.Event(), mp.Queue()
        base = pool.for_episode(adversary)
        url = base + f"/polar/{capability(pool.secret, adversary)}/v1/chat/completions"
        adv = mp.Process(target=adversary_process, args=(base, url, args.bomb_mib, args.flood,
                                                                   adversary_kind == "flood", stop, results))
        adv.start()
        ready = await asyncio.to_thread(results.get, True, 300)  # the adversary is sending before the honest start
        assert ready == "ready", ready
        await asyncio.sleep(1.0)
    with Sampler({i: p for i, p in enumerate(procs)}) as rss:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=900)) as s:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(honest_episode(s, pool, e, calls) for e in eids))
            dt = time.perf_counter() - t0
    adv_out = {}
    if adv is not None:
        stop.set()
        adv_out = await asyncio.to_thread(results.get, True, 120)
        adv.join(30)
    if api is not None:
        adv_out["adversary"]["node paced accepts"] = api.paced
        await api.close()
    lat = [x for r in res for x in r[0]]
    firsts = [x for r in res for x in r[1]]
    per_proxy = {i: sum(pool.for_episode(e) == pool.procs[i].url for e in eids) for i in range(len(procs))}
    by_proxy = {i: [x for e, r in zip(eids, res) if pool.for_episode(e) == pool.procs[i].url for x in r[0]]
                for i in range(len(procs))}
    out = {"phase": adversary_kind, "episodes": len(eids), "calls": len(eids) * calls,
           "seconds": dt, "calls_per_s": len(eids) * calls / dt, "errors": sum(r[2] for r in res),
           "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
           "first_p50_ms": pct(firsts, 50) * 1e3, "first_p99_ms": pct(firsts, 99) * 1e3,
           "rss_peak_mib": {i: rss.peak[i] / 2**20 for i in rss.peak},
           "rss_growth_per_episode_kib": {i: (rss.peak[i] - before[i]) / 1024 / max(1, per_proxy[i])
                                          for i in rss.peak},
           "p99_ms_by_proxy": {i: pct(v, 99) * 1e3 for i, v in by_proxy.items()}}
    if adversary:
        out.update(adv_out, adversary_proxy=[p.url for p in pool.procs].index(pool.for_episode(adversary)))
    return out


def run_scale(args, backend_url: str, work: Path) -> list[dict]:
    logdir = work / "logs-scale"
    print(f"bomb: {len(bomb_body(args.bomb_mib))} bytes gzip, {args.bomb_mib} MiB inflated", flush=True)
    results = []
    with proxy_pool(backend_url, logdir, args.k, workdir=work / "proxies-scale",
                    sets={"polar_dialect": "vllm", "polar_logprobs_mode": "unknown"}) as pool:
        procs = [psutil.Process(p.pid) for p in pool.procs]
        for n, phase in enumerate(args.phases):
            eids = [f"s{n}-{i}" for i in range(args.episodes)]
            adv = f"s{n}-adversary" if phase != "quiet" else None
            r = asyncio.run(scale_phase(pool, procs, eids, args.calls, adv, phase, args))
            r.update(check_logs(logdir, eids, args.calls), k=args.k)
            results.append(r)
            print(json.dumps(r), flush=True)
    return results


async def streams_round(url: str, data: bytes, conc: int, per_client: int, label: str) -> dict:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
        async def client(i):
            out = []
            for _ in range(per_client):
                out.append(await stream_call(s, url, data, {"x-polar-episode": f"{label}-{i}",
                                                             "content-type": "application/json"}))
            return out
        t0 = time.perf_counter()
        res = [x for r in await asyncio.gather(*(client(i) for i in range(conc))) for x in r]
        dt = time.perf_counter() - t0
    firsts = [f for ok, _, f in res if ok and f is not None]
    return {"calls_per_s": len(res) / dt, "errors": sum(not ok for ok, _, _ in res),
            "first_p50_ms": pct(firsts, 50) * 1e3}


@contextlib.contextmanager
def profiled_proxy(work: Path, logdir: Path, upstream: str, out: Path):
    """The polar proxy run under cProfile (stats written when it exits on SIGTERM)."""
    port = free_port()
    cmd = [sys.executable, "-m", "cProfile", "-o", str(out), venv_bin("mitmdump"), "-q", "--listen-host",
           "127.0.0.1", "--listen-port", str(port), "--mode", f"reverse:{upstream}", "-s", str(addon_script()),
           "--set", f"polar_logdir={logdir}", "--set", f"confdir={work / 'mitmconf'}"]
    with running(cmd, log=work / f"mitmdump-prof-{port}.log", port=port, timeout=60) as p:
        yield p


def profile_summary(path: Path, top: int = 25) -> str:
    buf = io.StringIO()
    for _ in range(50):  # (written at the proxy's exit)
        if path.exists() and path.stat().st_size:
            break
        time.sleep(0.1)
    st = pstats.Stats(str(path), stream=buf)
    st.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def run_streams(args, backend_url: str, work: Path) -> list[dict]:
    data = body_bytes(True)
    results = []
    with contextlib.ExitStack() as stack:
        polar = stack.enter_context(proxy(work, work / "logs-streams", backend_url, addon=addon_script(),
                                          sets={"polar_dialect": "vllm", "polar_logprobs_mode": "unknown"}))
        bare = stack.enter_context(proxy(work, work / "unused", backend_url,
                                         sets={"scripts": str(BENCH / "stream_on.py")}))
        procs = {"polar": psutil.Process(polar.pid), "bare": psutil.Process(bare.pid)}
        urls = {"polar": polar.url, "bare": bare.url}
        for conc in args.streams:
            per = max(2, args.stream_calls // conc)
            for rep, path in enumerate(["polar", "bare", "bare", "polar"][: 2 if args.quick else 4]):
                before = procs[path].cpu_times()
                with Sampler({path: procs[path]}) as rss:
                    r = asyncio.run(streams_round(urls[path] + "/v1/chat/completions", data, conc, per,
                                                  f"st{conc}-{rep}"))
                after = procs[path].cpu_times()
                cpu_ms = (after.user + after.system - before.user - before.system) / (conc * per) * 1e3
                r.update(path=path, streams=conc, calls=conc * per, rss_peak_mib=rss.peak[path] / 2**20,
                         cpu_ms_per_call=cpu_ms)
                results.append(r)
                print(json.dumps(r), flush=True)
    if args.profile_dir:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
        for conc in args.streams:
            out = args.profile_dir / f"polar-{conc}.prof"
            with profiled_proxy(work, work / "logs-prof", backend_url, out) as p:
                asyncio.run(streams_round(p.url + "/v1/chat/completions", data, conc, max(2, args.stream_calls // conc),
                                          f"prof{conc}"))
            (args.profile_dir / f"polar-{conc}.txt").write_text(profile_summary(out))
            print(f"profile at {conc} streams: {out}", flush=True)
    return results


def report(scale: list[dict], streams: list[dict], args) -> str:
    lines = [f"bench_scale: {os.cpu_count()} cores, load average before the run {args.load_before}; "
             f"fake backend {args.chunks} chunks {args.gap_ms:g} ms apart (first after {args.first_ms:g} ms)", ""]
    if scale:
        lines += [f"Part 1: {args.episodes} honest episodes x {args.calls} streamed calls, K={args.k} proxies", "",
                  "| phase | calls/s | errors | lost / duplicated rows, unfinished logs | p50 ms | p99 ms | "
                  "first chunk p50 / p99 ms | p99 ms per proxy | peak RSS per proxy MiB | RSS growth per episode KiB | "
                  "adversary |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in scale:
            adv = "-"
            if r["phase"] != "quiet":
                adv = (f"proxy {r['adversary_proxy']}: " + ", ".join(f"{k}: {v}" for k, v in sorted(r["adversary"].items()))
                       + f"; {r['adversary_connects']} connects; unexpected answers {r['adversary_errors']}")
            rss = " / ".join(f"{v:.0f}" for v in r["rss_peak_mib"].values())
            per = " / ".join(f"{v:.0f}" for v in r["rss_growth_per_episode_kib"].values())
            lines.append(f"| {r['phase']} | {r['calls_per_s']:.1f} | {r['errors']} | {r['lost_rows']} / "
                         f"{r['duplicated_rows']}, {r['unfinished_logs']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
                         f"{r['first_p50_ms']:.0f} / {r['first_p99_ms']:.0f} | "
                         f"{' / '.join(f'{v:.0f}' for v in r['p99_ms_by_proxy'].values())} | {rss} | {per} | {adv} |")
        q = [r for r in scale if r["phase"] == "quiet"]
        for kind in PHASES[1:]:
            a = [r for r in scale if r["phase"] == kind]
            if q and a:
                qp99, ap99 = statistics.median(r["p99_ms"] for r in q), statistics.median(r["p99_ms"] for r in a)
                qp50, ap50 = statistics.median(r["p50_ms"] for r in q), statistics.median(r["p50_ms"] for r in a)
                lines += ["", f"Honest p99 with the {kind} adversary / without: {ap99:.0f} / {qp99:.0f} ms = "
                              f"{ap99 / qp99:.2f}x; p50 {ap50:.0f} / {qp50:.0f} ms = {ap50 / qp50:.2f}x "
                              f"(medians over the phases)"]
    if streams:
        lines += ["", "Part 2: one proxy process vs bare mitmdump with streaming on, 79 KB Qwen Code request", "",
                  "| streams | polar calls/s | bare calls/s | polar / bare | first chunk p50 ms polar / bare | "
                  "errors polar / bare | peak RSS MiB polar / bare | proxy CPU ms per call polar / bare |",
                  "|---|---|---|---|---|---|---|---|"]
        for conc in args.streams:
            per = {p: [r for r in streams if r["streams"] == conc and r["path"] == p] for p in ("polar", "bare")}
            med = {p: {k: statistics.median(r[k] for r in per[p]) for k in
                       ("calls_per_s", "first_p50_ms", "rss_peak_mib", "cpu_ms_per_call")} for p in per}
            errs = {p: sum(r["errors"] for r in per[p]) for p in per}
            lines.append(f"| {conc} | {med['polar']['calls_per_s']:.1f} | {med['bare']['calls_per_s']:.1f} | "
                         f"{med['polar']['calls_per_s'] / med['bare']['calls_per_s']:.2f}x | "
                         f"{med['polar']['first_p50_ms']:.0f} / {med['bare']['first_p50_ms']:.0f} | "
                         f"{errs['polar']} / {errs['bare']} | {max(r['rss_peak_mib'] for r in per['polar']):.0f} / "
                         f"{max(r['rss_peak_mib'] for r in per['bare']):.0f} | "
                         f"{med['polar']['cpu_ms_per_call']:.2f} / {med['bare']['cpu_ms_per_call']:.2f} |")
    return "\n".join(lines)


PHASES = ("quiet", "bodies", "flood", "socket-flood", "socket-flood-unpaced")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 episodes, 2 phases, a 4 MiB bomb, streams 16")
    ap.add_argument("--episodes", type=int, default=1024)
    ap.add_argument("--k", type=int, default=2, help="capture proxies for part 1")
    ap.add_argument("--calls", type=int, default=2, help="streamed calls per honest episode")
    ap.add_argument("--bomb-mib", type=float, default=45)
    ap.add_argument("--flood", type=int, default=256, help="idle connections the adversary holds open")
    ap.add_argument("--phases", default="quiet,bodies,flood,quiet",
                    help="quiet (no adversary) | bodies (bombs, nested JSON, --flood idle connections) | flood (the "
                         "same and connect/close in a loop) | socket-flood, socket-flood-unpaced (connect/close "
                         "through the episode's model API socket, paced or not), comma-separated, in this order")
    ap.add_argument("--streams", default="64,256", help="part 2: concurrent streams, comma-separated")
    ap.add_argument("--stream-calls", type=int, default=512, help="part 2: calls per round (at least 2 per client)")
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("--gap-ms", type=float, default=20)
    ap.add_argument("--first-ms", type=float, default=20)
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--skip-streams", action="store_true")
    ap.add_argument("--profile-dir", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.quick:
        args.episodes, args.bomb_mib, args.flood, args.stream_calls = 64, 4, 16, 64
        args.streams = "16"
    args.streams = [int(x) for x in str(args.streams).split(",")]
    args.phases = [x.strip() for x in args.phases.split(",")]
    if not set(args.phases) <= set(PHASES):
        ap.error(f"--phases: {', '.join(PHASES)}, not {args.phases}")
    args.load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    scale, streams = [], []
    with fake_backend(work, "vllm", chunks=args.chunks, gap_ms=args.gap_ms, first_ms=args.first_ms) as be:
        if not args.skip_scale:
            scale = run_scale(args, be.url, work)
        if not args.skip_streams:
            streams = run_streams(args, be.url, work)
    text = report(scale, streams, args)
    print("\n" + text)
    if args.json:
        args.json.write_text(json.dumps({"scale": scale, "streams": streams, "report": text}, indent=1, default=str))
    bad = sum(r["errors"] + r["lost_rows"] + r["duplicated_rows"] + r["unfinished_logs"] + r.get("adversary_errors", 0)
              for r in scale) + sum(r["errors"] for r in streams)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
