"""What the capture addon costs: direct vs bare mitmdump (streaming on) vs mitmdump + polar addon,
side by side in one run, requests interleaved across the paths. A fourth path, bare mitmdump with
only the addon's fast event dispatch (addon/mitmproxy_patches.py), separates the addon's own cost
from what that dispatch saves every flow; a fifth, "polar-stock", is the addon with its mitmproxy
patches off (stock mitmproxy's dispatch, backlog and collector): the capture's cost on stock mitmproxy.

    .venv/bin/python bench/bench_proxy.py            # default run, about 2 minutes
    .venv/bin/python bench/bench_proxy.py --quick    # smaller counts, for a smoke check
    .venv/bin/python bench/bench_proxy.py --real-vllm [--vllm-url URL]   # the real vLLM upstream (below)

Backend: bench/fake_backend.py speaking vLLM's shapes with ids (non-streaming answers at once;
streams of 60 chunks 5 ms apart, first after 20 ms: the anchors in docs/benchmarks/proxy.md,
"Anchors measured before the addon").
Request body: the real 79 KB Qwen Code request (tests/fixtures/harness-requests/qwen-code.jsonl).
Reports: per-call latency p50/p99 and the added ms, time to first chunk, calls/s with 64 and 256
concurrent streams, proxy CPU per call (psutil on the mitmdump pid), peak RSS, log bytes per call,
and the log size of a 50-call episode whose prompts grow by ~1,500 tokens a call, against the
bytes of its distinct tokens (4 bytes a token), with prompt ids from the real Qwen3 tokenizer.

--real-vllm: the real vLLM 0.32 (CPU build, `make vllm`; started on the tiny Qwen3 unless
--vllm-url names a running one serving it as `polar-model`) as the upstream, and the three real
Qwen Code requests (~17.5k-token prompts, 80 KB) in turn, greedy, --max-tokens each, non-streaming
and streamed: paths "direct" (the harness's request straight to vLLM), "direct+flags" (the same
with the id/logprob flags the proxy adds: the server's share of the capture's cost) and "polar"
(through mitmdump + the addon), interleaved call by call. Reports the server's own time per call
and the capture's added latency as a ratio of it (paired per round), split into the server's
share (the flags) and the proxy's; and checks every row of the log says success.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import psutil

from harness_recipes.node.local_stack import addon_script, mitmdump
from harness_recipes.node.processes import free_port, running
from polar_contracts.assets import QWEN3_TOKENIZER
from polar_contracts.log.reader import read_episode

BENCH = Path(__file__).resolve().parent
QWEN = BENCH.parent / "tests" / "fixtures" / "harness-requests" / "qwen-code.jsonl"
TOKENIZER = QWEN3_TOKENIZER / "tokenizer.json"


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


class Sampler:
    """Peak RSS of the proxy processes while a phase runs."""

    def __init__(self, procs: dict[str, psutil.Process]):
        self.procs = procs
        self.peak = {k: 0 for k in procs}
        self._stop = threading.Event()

    def __enter__(self):
        self.peak = {k: 0 for k in self.procs}
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            for k, p in self.procs.items():
                try:
                    self.peak[k] = max(self.peak[k], p.memory_info().rss)
                except psutil.Error:
                    pass
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


async def one_call(session, url, data: bytes, headers, stream: bool):
    """(ok, total seconds, seconds to first body chunk)."""
    t0 = time.perf_counter()
    ttfc = None
    try:
        async with session.post(url, data=data, headers=headers) as r:
            if stream:
                tail = b""
                async for chunk in r.content.iter_any():
                    if ttfc is None:
                        ttfc = time.perf_counter() - t0
                    tail = (tail + chunk)[-32:]
                ok = r.status == 200 and tail.endswith(b"data: [DONE]\n\n")
            else:
                body = await r.read()
                ttfc = time.perf_counter() - t0
                ok = r.status == 200 and body.startswith(b"{")
    except (TimeoutError, aiohttp.ClientError):
        ok = False
    return ok, time.perf_counter() - t0, ttfc


def body_bytes(stream: bool) -> bytes:
    body = json.loads(QWEN.read_text().splitlines()[0])["body"]
    body["stream"] = stream
    if not stream:
        body.pop("stream_options", None)
    body["max_tokens"] = 60
    return json.dumps(body).encode()


async def sequential(paths, data, stream, n, session):
    """n calls per path, interleaved path by path; returns per path (latencies, ttfcs, errors,
    per-round (latency, ttfc) or None for a failed call: rounds line up across paths)."""
    out = {k: ([], [], 0, []) for k in paths}
    order = list(paths.items())
    for i in range(n):
        # the order rotates every round: going first in a round is measurably different
        # (up to 1 ms here), and must not always fall on the same path
        r = i % len(order)
        for k, url in order[r:] + order[:r]:
            headers = {"x-polar-episode": f"seq-{k}", "content-type": "application/json"}
            ok, t, f = await one_call(session, url, data, headers, stream)
            lat, tt, err, rounds = out[k]
            if ok:
                lat.append(t)
                tt.append(f)
            rounds.append((t, f) if ok else None)
            out[k] = (lat, tt, err + (not ok), rounds)
    return out


def paired_ms(r: dict, a: str, b: str, which: int) -> float:
    """Median over rounds of (path a - path b) for calls made back to back in the same round:
    load that drifts over the run (this machine is shared) cancels out of each difference."""
    d = [(x[which] - y[which]) * 1e3 for x, y in zip(r[a][3], r[b][3]) if x is not None and y is not None]
    return statistics.median(d) if d else float("nan")


async def concurrent(url, data, conc, per_client, label, stream=True):
    """conc clients, each doing per_client calls back to back; returns (calls/s, errors)."""
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        async def client(i):
            errs = 0
            for _ in range(per_client):
                ok, _, _ = await one_call(s, url, data, {"x-polar-episode": f"{label}-{i}",
                                                        "content-type": "application/json"}, stream)
                errs += not ok
            return errs

        t0 = time.perf_counter()
        errs = sum(await asyncio.gather(*(client(i) for i in range(conc))))
        dt = time.perf_counter() - t0
    return conc * per_client / dt, errs


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.arrow")) if d.exists() else 0


# ---------------------------------------------------------------------------------------------
# the growing episode


def growing_messages(base: dict, n_calls: int, grow_tokens: int, tok):
    """Requests of one agent episode: each adds the model's reply and a ~grow_tokens tool result
    (real code text from the installed packages, so the tokens and text are realistic)."""
    src = [p for p in sorted((Path(psutil.__file__).parent).glob("*.py"))]
    text = "".join(p.read_text(errors="replace") for p in src)
    ids = tok.encode(text, add_special_tokens=False).ids
    pos = 0
    msgs = list(base["messages"])
    for i in range(n_calls):
        yield {**base, "messages": list(msgs)}
        piece = tok.decode(ids[pos: pos + grow_tokens])
        pos += grow_tokens
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": f"f{i}.py"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{i}", "content": piece})


async def growing_episode(url: str, logdir: Path, n_calls: int, grow: int):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    base = json.loads(QWEN.read_text().splitlines()[0])["body"]
    base["max_tokens"] = 40
    async with aiohttp.ClientSession() as s:
        for body in growing_messages(base, n_calls, grow, tok):
            ok, _, _ = await one_call(s, url, json.dumps(body).encode(),
                                      {"x-polar-episode": "growing", "content-type": "application/json"}, True)
            assert ok, "growing-episode call failed"
    ep = read_episode(logdir / "growing.arrow")
    last = ep.calls.row(ep.calls.height - 1, named=True)
    distinct = len(last["prompt_ids"]) + len(last["completion_ids"])
    size = (logdir / "growing.arrow").stat().st_size
    grows = [len(b) - len(a) for a, b in zip(ep.calls["prompt_ids"].to_list(), ep.calls["prompt_ids"].to_list()[1:])]
    return dict(calls=ep.calls.height, file_bytes=size, distinct_tokens=distinct, distinct_bytes=distinct * 4,
                ratio=size / (distinct * 4), mean_growth_tokens=statistics.mean(grows) if grows else 0,
                request_text_bytes=sum(len(r.encode()) for r in ep.calls["request"].to_list()))


# ---------------------------------------------------------------------------------------------


async def run(args, paths, procs, logdir):
    res: dict = {}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        nonstream, stream = body_bytes(False), body_bytes(True)
        await sequential(paths, nonstream, False, 5, s)  # warm up (connections, dialect, imports)
        await sequential(paths, stream, True, 2, s)
        c0 = {k: cpu(p) for k, p in procs.items()}
        r = await sequential(paths, nonstream, False, args.n, s)
        c1 = {k: cpu(p) for k, p in procs.items()}
        res["nonstream"] = {k: dict(p50=pct(v[0], 50) * 1e3, p99=pct(v[0], 99) * 1e3, errors=v[2]) for k, v in r.items()}
        res["paired_nonstream_ms"] = {k: paired_ms(r, k, "bare+stream", 0) for k in r if k != "bare+stream"}
        res["own_nonstream_ms"] = paired_ms(r, "polar", "bare+dispatch", 0)  # the addon's own share
        res["cpu_nonstream_ms"] = {k: (c1[k] - c0[k]) / args.n * 1e3 for k in procs}
        c0 = {k: cpu(p) for k, p in procs.items()}
        r = await sequential(paths, stream, True, args.n_stream, s)
        c1 = {k: cpu(p) for k, p in procs.items()}
        res["stream"] = {k: dict(ttfc_p50=pct(v[1], 50) * 1e3, ttfc_p99=pct(v[1], 99) * 1e3, total_p50=pct(v[0], 50) * 1e3,
                                 errors=v[2]) for k, v in r.items()}
        res["paired_ttfc_ms"] = {k: paired_ms(r, k, "bare+stream", 1) for k in r if k != "bare+stream"}
        res["own_ttfc_ms"] = paired_ms(r, "polar", "bare+dispatch", 1)
        res["cpu_stream_ms"] = {k: (c1[k] - c0[k]) / args.n_stream * 1e3 for k in procs}
    # non-streaming under load (a rollout node's many episodes): the proxy saturates its one core,
    # so CPU per call is what a call costs, without the idle wake-ups of the sequential phase
    res["ns16"] = {k: dict(calls_per_s=[], cpu_per_call_ms=[], errors=0) for k in procs}
    nonstream = body_bytes(False)
    for _ in range(2):  # two passes, paths alternating, against drift
        for k in procs:
            c0 = cpu(procs[k])
            rate, errs = await concurrent(paths[k], nonstream, 16, args.rounds_ns16, f"ns16-{k}", stream=False)
            r = res["ns16"][k]
            r["calls_per_s"].append(rate)
            r["cpu_per_call_ms"].append((cpu(procs[k]) - c0) / (16 * args.rounds_ns16) * 1e3)
            r["errors"] += errs
    for r in res["ns16"].values():
        r["calls_per_s"], r["cpu_per_call_ms"] = statistics.mean(r["calls_per_s"]), statistics.mean(r["cpu_per_call_ms"])
    for conc, rounds in ((64, args.rounds64), (256, args.rounds256)):
        res[f"c{conc}"] = {}
        for k, url in paths.items():
            sampler = Sampler({k: procs[k]} if k in procs else {})
            c0 = cpu(procs[k]) if k in procs else None
            with sampler:
                rate, errs = await concurrent(url, stream, conc, rounds, f"c{conc}-{k}")
            # (many more calls than the sequential phase: CPU per streamed call at 10 ms tick resolution)
            cpu_ms = (cpu(procs[k]) - c0) / (conc * rounds) * 1e3 if c0 is not None else None
            res[f"c{conc}"][k] = dict(calls_per_s=rate, errors=errs, peak_rss_mib=sampler.peak.get(k, 0) / 2**20,
                                      cpu_per_call_ms=cpu_ms)
    calls = sum(1 for _ in logdir.glob("*.arrow"))
    total_calls = sum(read_episode(p).calls.height for p in logdir.glob("*.arrow"))
    res["log"] = dict(files=calls, calls=total_calls, bytes=dir_bytes(logdir),
                      bytes_per_call=dir_bytes(logdir) / max(1, total_calls))
    return res


def report(res, growing, args):
    paths = list(res["nonstream"])
    w = 14
    print(f"\n{'':28}" + "".join(f"{k:>{w}}" for k in paths))

    def line(name, vals, fmt="{:.2f}"):
        print(f"{name:28}" + "".join(f"{(fmt.format(v) if v is not None else '-'):>{w}}" for v in vals))

    ns, st = res["nonstream"], res["stream"]
    line("non-stream p50 ms", [ns[k]["p50"] for k in paths])
    line("non-stream p99 ms", [ns[k]["p99"] for k in paths])
    line("first chunk p50 ms", [st[k]["ttfc_p50"] for k in paths])
    line("first chunk p99 ms", [st[k]["ttfc_p99"] for k in paths])
    line("stream total p50 ms", [st[k]["total_p50"] for k in paths])
    line("64 streams calls/s", [res["c64"][k]["calls_per_s"] for k in paths], "{:.1f}")
    line("256 streams calls/s", [res["c256"][k]["calls_per_s"] for k in paths], "{:.1f}")
    line("errors (all phases)", [ns[k]["errors"] + st[k]["errors"] + res["c64"][k]["errors"] + res["c256"][k]["errors"]
                                 + res["ns16"].get(k, {}).get("errors", 0) for k in paths], "{:d}")
    line("proxy CPU/non-stream ms", [res["cpu_nonstream_ms"].get(k) for k in paths])
    line("proxy CPU/stream call ms", [res["cpu_stream_ms"].get(k) for k in paths])
    line("16 non-stream: calls/s", [res["ns16"][k]["calls_per_s"] if k in res["ns16"] else None for k in paths], "{:.0f}")
    line("16 non-stream: CPU/call ms", [res["ns16"][k]["cpu_per_call_ms"] if k in res["ns16"] else None for k in paths])
    line("proxy CPU/call 64 streams", [res["c64"][k]["cpu_per_call_ms"] for k in paths])
    line("proxy CPU/call 256 streams", [res["c256"][k]["cpu_per_call_ms"] for k in paths])
    line("peak RSS 64 streams MiB", [res["c64"][k]["peak_rss_mib"] or None for k in paths], "{:.0f}")
    line("peak RSS 256 streams MiB", [res["c256"][k]["peak_rss_mib"] or None for k in paths], "{:.0f}")
    b, a, f = "bare+stream", "polar", "bare+dispatch"
    print("\naddon vs bare mitmdump (streaming on):")
    print(f"  added non-stream p50 {ns[a]['p50'] - ns[b]['p50']:+.2f} ms (target <= 1), "
          f"p99 {ns[a]['p99'] - ns[b]['p99']:+.2f} ms; median of paired differences "
          f"{res['paired_nonstream_ms'][a]:+.2f} ms")
    print(f"  added first-chunk p50 {st[a]['ttfc_p50'] - st[b]['ttfc_p50']:+.2f} ms (target <= 2); median of paired "
          f"differences {res['paired_ttfc_ms'][a]:+.2f} ms")
    print(f"  addon's own proxy CPU per 80 KB non-stream call (over bare) "
          f"{res['cpu_nonstream_ms'][a] - res['cpu_nonstream_ms'][b]:+.2f} ms")
    print(f"  addon proxy CPU per 80 KB non-stream call {res['cpu_nonstream_ms'][a]:.2f} ms one call at a time, "
          f"{res['ns16'][a]['cpu_per_call_ms']:.2f} ms under load (16 clients; bare {res['ns16'][b]['cpu_per_call_ms']:.2f}) "
          f"(target <= 2.5)")
    print(f"  the addon's own share (vs bare mitmdump with the same fast dispatch): non-stream p50 "
          f"{res['own_nonstream_ms']:+.2f} ms paired, first chunk {res['own_ttfc_ms']:+.2f} ms paired, "
          f"CPU per non-stream call "
          f"{res['cpu_nonstream_ms'][a] - res['cpu_nonstream_ms'][f]:+.2f} ms one at a time, "
          f"{res['ns16'][a]['cpu_per_call_ms'] - res['ns16'][f]['cpu_per_call_ms']:+.2f} ms under load")
    s = "polar-stock"
    print(f"  the capture on stock mitmproxy (addon with its mitmproxy patches off) vs with them, over bare: "
          f"non-stream p50 {res['paired_nonstream_ms'][s]:+.2f} vs {res['paired_nonstream_ms'][a]:+.2f} ms paired, "
          f"first chunk {res['paired_ttfc_ms'][s]:+.2f} vs {res['paired_ttfc_ms'][a]:+.2f} ms paired, CPU per "
          f"non-stream call {res['cpu_nonstream_ms'][s] - res['cpu_nonstream_ms'][b]:+.2f} vs "
          f"{res['cpu_nonstream_ms'][a] - res['cpu_nonstream_ms'][b]:+.2f} ms one at a time, "
          f"{res['ns16'][s]['cpu_per_call_ms'] - res['ns16'][b]['cpu_per_call_ms']:+.2f} vs "
          f"{res['ns16'][a]['cpu_per_call_ms'] - res['ns16'][b]['cpu_per_call_ms']:+.2f} ms under load; "
          f"256 streams errors {res['c256'][s]['errors']} vs {res['c256'][a]['errors']}")
    print(f"  peak RSS at 64 streams {res['c64'][a]['peak_rss_mib']:.0f} MiB (target <= 300); "
          f"256 streams errors {res['c256'][a]['errors']} (target 0)")
    if "baseline" in ns:
        o = "baseline"
        print(f"  baseline addon: added non-stream p50 {ns[o]['p50'] - ns[b]['p50']:+.2f} ms (paired "
              f"{res['paired_nonstream_ms'][o]:+.2f}), first-chunk p50 {st[o]['ttfc_p50'] - st[b]['ttfc_p50']:+.2f} ms "
              f"(paired {res['paired_ttfc_ms'][o]:+.2f}), CPU per non-stream call "
              f"{res['cpu_nonstream_ms'][o]:.2f} ms, per stream call {res['cpu_stream_ms'][o]:.2f} ms "
              f"(this addon: {res['cpu_stream_ms'][a]:.2f}, bare {res['cpu_stream_ms'][b]:.2f})")
    lg = res["log"]
    print(f"  log: {lg['calls']} calls in {lg['files']} episodes, {lg['bytes_per_call']:.0f} bytes per call "
          f"(repeated 80 KB request)")
    g = growing
    print(f"\ngrowing episode: {g['calls']} calls, prompts grow {g['mean_growth_tokens']:.0f} tokens a call; "
          f"log {g['file_bytes']} bytes vs {g['distinct_tokens']} distinct tokens x 4 = {g['distinct_bytes']} bytes: "
          f"ratio {g['ratio']:.2f} (target <= 1.5); full request texts would be {g['request_text_bytes']} bytes")


# the addon's options that turn its mitmproxy patches off (path "polar-stock")
STOCK_MITMPROXY = {"polar_fast_dispatch": "false", "polar_listen_backlog": "0", "polar_gc_freeze": "false"}


def fake_backend(work: Path, dialect: str = "vllm", *, chunks: int = 12, gap_ms: float = 0, first_ms: float = 0,
                 tokenizer: str | None = None):
    """bench/fake_backend.py on a free port, output to WORK/fake-PORT.log."""
    port = free_port()
    cmd = [sys.executable, str(BENCH / "fake_backend.py"), "--port", str(port), "--dialect", dialect,
           "--chunks", str(chunks), "--gap-ms", str(gap_ms), "--first-ms", str(first_ms)]
    if tokenizer:
        cmd += ["--tokenizer", tokenizer]
    return running(cmd, log=work / f"fake-{port}.log", port=port, timeout=30)


@contextlib.contextmanager
def proxy(work: Path, logdir: Path, upstream: str, *, addon: Path | None = None, sets: dict | None = None,
          env: dict | None = None):
    """mitmdump in front of `upstream` with the mitmproxy script `addon` (None: bare), as the tests run it."""
    port = free_port()
    with mitmdump(upstream=upstream, logdir=logdir, addon=addon, confdir=work / "mitmconf", sets=sets, port=port,
                  log=work / f"mitmdump-{port}.log", cwd=work, env=env, timeout=30) as p:
        yield p


# ---------------------------------------------------------------------------------------------
# --real-vllm


def qwen_code_bodies(max_tokens: int, stream: bool, model: str) -> list[dict]:
    out = []
    for line in QWEN.read_text().splitlines():
        body = {**json.loads(line)["body"], "model": model, "max_tokens": max_tokens, "temperature": 0,
                "stream": stream}
        if not stream:
            body.pop("stream_options", None)
        out.append(body)
    return out


async def real_vllm_phase(paths: dict, stream: bool, n: int, max_tokens: int, model: str) -> dict:
    """n rounds; each round one call per path (the order rotating), the same request on every path."""
    from addon.server_dialects import plan_request

    bodies = qwen_code_bodies(max_tokens, stream, model)
    datas = {"plain": [json.dumps(b).encode() for b in bodies],
             "flags": [json.dumps({**b, **plan_request("chat", "vllm", b).added}).encode() for b in bodies]}
    out = {k: [] for k in paths}
    order = list(paths.items())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        for i in range(n):
            r = i % len(order)
            for k, (url, kind) in order[r:] + order[:r]:
                headers = {"x-polar-episode": f"real-{'stream' if stream else 'whole'}-{k}",
                           "content-type": "application/json"}
                ok, t, f = await one_call(s, url, datas[kind][i % len(bodies)], headers, stream)
                out[k].append((t, f) if ok else None)
    return out


def real_vllm_stats(rounds: dict, which: int) -> dict:
    def paired(a, b):
        d = [x[which] - y[which] for x, y in zip(rounds[a], rounds[b]) if x is not None and y is not None]
        return statistics.median(d) * 1e3 if d else float("nan")

    own = [x[which] * 1e3 for x in rounds["direct"] if x is not None]
    server = statistics.median(own)
    res = {k: dict(p50=pct([x[which] * 1e3 for x in v if x is not None], 50),
                   p99=pct([x[which] * 1e3 for x in v if x is not None], 99),
                   errors=sum(x is None for x in v)) for k, v in rounds.items()}
    added, flags, proxy_ = paired("polar", "direct"), paired("direct+flags", "direct"), paired("polar", "direct+flags")
    return dict(paths=res, server_ms=server, added_ms=added, flags_ms=flags, proxy_ms=proxy_,
                ratio=added / server, flags_ratio=flags / server, proxy_ratio=proxy_ / server)


def real_vllm_main(args) -> None:
    from harness_recipes.cache import tiny_model
    from harness_recipes.node.local_stack import vllm

    model = "polar-model"
    with tempfile.TemporaryDirectory(prefix="polar-bench-vllm-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        logdir = work / "logs"
        url = args.vllm_url
        if not url:
            print("starting the real vLLM on the tiny Qwen3 (1-2 minutes) ...", flush=True)
            url = stack.enter_context(vllm(tiny_model(), model_name=model, log=work / "vllm.log")).url
        polar = stack.enter_context(proxy(work, logdir, url, addon=addon_script(), sets={"polar_dialect": "vllm"}))
        paths = {"direct": (url + "/v1/chat/completions", "plain"),
                 "direct+flags": (url + "/v1/chat/completions", "flags"),
                 "polar": (polar.url + "/v1/chat/completions", "plain")}
        t0 = time.time()
        # warm-up: the prefix cache holds the three prompts, the proxy has made its episode files
        asyncio.run(real_vllm_phase(paths, False, 3, args.max_tokens, model))
        res = {"whole": real_vllm_stats(asyncio.run(real_vllm_phase(paths, False, args.n_real, args.max_tokens,
                                                                    model)), 0),
               "stream": real_vllm_stats(asyncio.run(real_vllm_phase(paths, True, args.n_real, args.max_tokens,
                                                                     model)), 1)}
        rows = [r for p in logdir.glob("*.arrow") for r in read_episode(p).calls.iter_rows(named=True)]
        whole = [r for r in rows if not r["stream"]]
        res["log"] = dict(rows=len(rows), errors=sum(r["error"] is not None for r in rows),
                          mean_prompt_ids=statistics.mean(len(r["prompt_ids"] or ()) for r in rows),
                          # the proxy's own clock: answer headers in -> row written (the 83 KB answer read,
                          # parsed, stripped, logged), non-streaming calls
                          answer_ms_p50=pct([(r["t_end"] - r["t_first_byte"]) * 1e3 for r in whole], 50),
                          answer_ms_p99=pct([(r["t_end"] - r["t_first_byte"]) * 1e3 for r in whole], 99))
        res["wall_s"] = time.time() - t0
    print(f"\nreal vLLM upstream ({url}), Qwen Code requests of ~{res['log']['mean_prompt_ids']:.0f} prompt tokens, "
          f"max_tokens {args.max_tokens}, greedy; {args.n_real} rounds per mode, paths interleaved")
    print(f"{'':34}{'direct':>14}{'direct+flags':>14}{'polar':>14}")
    for mode, label in (("whole", "non-stream latency"), ("stream", "stream first chunk")):
        r = res[mode]
        for q in ("p50", "p99"):
            print(f"{label + ' ' + q + ' ms':34}" + "".join(f"{r['paths'][k][q]:>14.1f}" for k in r["paths"]))
    for mode, label in (("whole", "non-stream"), ("stream", "stream, first chunk")):
        r = res[mode]
        print(f"{label}: server's own time {r['server_ms']:.1f} ms; capture adds {r['added_ms']:+.1f} ms = "
              f"{r['ratio']:.3f} x (server's share for the flags {r['flags_ms']:+.1f} ms = {r['flags_ratio']:.3f} x, "
              f"the proxy's {r['proxy_ms']:+.1f} ms = {r['proxy_ratio']:.3f} x; medians of paired differences)")
    lg = res["log"]
    print(f"the proxy's own clock per non-stream call, answer headers in -> row written: p50 {lg['answer_ms_p50']:.1f} ms, "
          f"p99 {lg['answer_ms_p99']:.1f} ms")
    errs = sum(res[m]["paths"][k]["errors"] for m in ("whole", "stream") for k in res[m]["paths"])
    print(f"calls failed: {errs}; log rows {res['log']['rows']}, rows with an error: {res['log']['errors']}")
    print(f"(wall time {res['wall_s']:.0f} s; machine: {os.cpu_count()} CPUs, shared)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small counts (smoke check)")
    ap.add_argument("--real-vllm", action="store_true", help="the real vLLM as the upstream (see above)")
    ap.add_argument("--vllm-url", help="--real-vllm: a running vLLM serving the tiny Qwen3 as polar-model")
    ap.add_argument("--n-real", type=int, default=100, help="--real-vllm: rounds per mode (3 calls a round)")
    ap.add_argument("--max-tokens", type=int, default=16, help="--real-vllm: tokens generated per call")
    ap.add_argument("--n", type=int, default=150, help="non-stream calls per path")
    ap.add_argument("--n-stream", type=int, default=40, help="sequential streaming calls per path")
    ap.add_argument("--rounds64", type=int, default=3)
    ap.add_argument("--rounds-ns16", type=int, default=30, help="non-stream calls per client, 16 clients")
    ap.add_argument("--rounds256", type=int, default=2)
    ap.add_argument("--grow-calls", type=int, default=50)
    ap.add_argument("--grow-tokens", type=int, default=1500)
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--baseline", metavar="CHECKOUT",
                    help="also run the addon of another checkout (e.g. a copy of the previous commit) "
                         "as path 'baseline', interleaved with the others: before/after in one run")
    args = ap.parse_args(argv)
    if args.real_vllm:
        if args.quick:
            args.n_real = 5
        real_vllm_main(args)
        return
    if args.quick:
        args.n, args.n_stream, args.rounds64, args.rounds256, args.grow_calls, args.rounds_ns16 = 20, 4, 1, 1, 10, 3
    with tempfile.TemporaryDirectory(prefix="polar-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        logdir = work / "logs"
        be = stack.enter_context(fake_backend(work, "vllm", chunks=60, gap_ms=5, first_ms=20))
        bare = stack.enter_context(proxy(work, work / "unused", be.url, sets={"scripts": str(BENCH / "stream_on.py")}))
        fast = stack.enter_context(proxy(work, work / "unused", be.url,
                                         sets={"scripts": str(BENCH / "stream_on_fast_dispatch.py")}))
        polar = stack.enter_context(proxy(work, logdir, be.url, addon=addon_script(), sets={"polar_dialect": "vllm"}))
        # the same addon with its mitmproxy patches off (addon/mitmproxy_patches.py): the capture on stock mitmproxy
        stock = stack.enter_context(proxy(work, work / "stocklogs", be.url, addon=addon_script(),
                                          sets={"polar_dialect": "vllm", **STOCK_MITMPROXY}))
        paths = {"direct": be.url + "/v1/chat/completions", "bare+stream": bare.url + "/v1/chat/completions",
                 "bare+dispatch": fast.url + "/v1/chat/completions", "polar": polar.url + "/v1/chat/completions",
                 "polar-stock": stock.url + "/v1/chat/completions"}
        procs = {"bare+stream": psutil.Process(bare.pid), "bare+dispatch": psutil.Process(fast.pid),
                 "polar": psutil.Process(polar.pid), "polar-stock": psutil.Process(stock.pid)}
        if args.baseline:  # the addon of another checkout, side by side in the same run
            # (the other checkout's packages first, else its polar_addon.py imports this one's)
            other = Path(args.baseline).resolve()
            base = stack.enter_context(proxy(work, work / "baselogs", be.url, addon=other / "addon" / "polar_addon.py",
                                             sets={"polar_dialect": "vllm"}, env={**os.environ, "PYTHONPATH": str(other)}))
            paths["baseline"] = base.url + "/v1/chat/completions"
            procs["baseline"] = psutil.Process(base.pid)
        t0 = time.time()
        res = asyncio.run(run(args, paths, procs, logdir))
        # the growing episode needs real prompt ids: a backend that tokenizes with the Qwen3 tokenizer
        glog = work / "glogs"
        tb = stack.enter_context(fake_backend(work, "vllm", chunks=40, tokenizer=str(TOKENIZER)))
        gp = stack.enter_context(proxy(work, glog, tb.url, addon=addon_script(), sets={"polar_dialect": "vllm"}))
        growing = asyncio.run(growing_episode(gp.url + "/v1/chat/completions", glog, args.grow_calls, args.grow_tokens))
        report(res, growing, args)
        print(f"\n(bench wall time {time.time() - t0:.0f} s; machine: {os.cpu_count()} CPUs, shared)")
        if args.json:
            Path(args.json).write_text(json.dumps({"results": res, "growing": growing}, indent=2))


if __name__ == "__main__":
    main()
