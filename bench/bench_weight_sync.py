"""How long a weight sync through the capture proxy holds model calls, against the server's own load.

    .venv/bin/python bench/bench_weight_sync.py [--syncs 5] [--servers polar-serve,sglang,vllm] [--vllm-url URL]

For each server (polar-serve's vllm dialect, loaded by /polar/reload; polar-serve's sglang dialect,
loaded by SGLang's /update_weights_from_disk; real vLLM 0.32 with VLLM_SERVER_DEV_MODE=1, loaded by
/pause, /collective_rpc reload_weights, /update_weight_version, /resume; started here unless
--vllm-url names one), with the tiny Qwen3 and a perturbed copy of it loaded in turn:

- direct: the server's own load API called directly, no proxy (the baseline: what any sync costs);
- proxy idle: ``POST /polar/@weights`` with no call in flight: the time the gate is closed;
- proxy busy: the same while a streamed call (--busy-tokens tokens) is in flight (the drain waits for
  it) and a short call arrives during the sync: its latency minus the same call's latency when idle is
  the delay a harness sees.

Medians over 2 x --syncs syncs each; ratios are proxy / direct. Each vLLM sync ends with the original
weights loaded again (the last sync of every pair loads them).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from harness_recipes.cache import tiny_model
from harness_recipes.demo.weights import perturbed_copy
from harness_recipes.node.local_stack import addon_script, mitmdump, serve, vllm

# vLLM registers its RL and dev routes (/weight_info, /pause, /collective_rpc, ...) only with this
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


def direct_load(kind: str, url: str, path: str, version: str) -> float:
    t = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as c:
        if kind == "vllm":
            c.post("/pause?mode=wait").raise_for_status()
            try:
                c.post("/collective_rpc", json={"method": "reload_weights",
                                                "kwargs": {"weights_path": path}}).raise_for_status()
                c.post("/update_weight_version", json={"new_version": version}).raise_for_status()
            finally:
                c.post("/resume").raise_for_status()
        elif kind == "sglang":
            r = c.post("/update_weights_from_disk", json={"model_path": path, "weight_version": version})
            assert r.json()["success"], r.text
        else:
            c.post("/polar/reload", json={"model": path, "weight_version": version}).raise_for_status()
    return time.perf_counter() - t


def call(url: str, model: str, tokens: int, out: list | None = None, started: threading.Event | None = None,
         stream: bool = False) -> float:
    body = {"model": model, "max_tokens": tokens, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True,
            "stream": stream, "messages": [{"role": "user", "content": "Count."}]}
    t = time.perf_counter()
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for _ in r.iter_raw():
            if started is not None:
                started.set()
        assert r.status_code == 200
    dt = time.perf_counter() - t
    if out is not None:
        out.append(dt)
    return dt


def proxy_sync(px: str, path: str, version: str) -> dict:
    t = time.perf_counter()
    r = httpx.post(px + "/polar/@weights", json={"path": path, "version": version}, timeout=600)
    assert r.status_code == 200, r.text
    return {**r.json(), "wall": time.perf_counter() - t}


def bench_server(kind: str, url: str, work: Path, paths: list[str], syncs: int, busy_tokens: int) -> dict:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    res = {"direct": [], "idle": [], "busy": [], "delay": [], "short_idle": []}
    n = 0

    def next_version():
        nonlocal n
        n += 1
        return paths[n % 2], f"bench-{n}" if n % 2 else "default"  # even syncs: the original, as "default"

    for _ in range(syncs):
        for _ in range(2):
            p, v = next_version()
            res["direct"].append(direct_load(kind, url, p, v))
    sets = {"polar_dialect": "sglang" if kind == "sglang" else "vllm"}
    with mitmdump(upstream=url, logdir=work / f"logs-{kind}", addon=addon_script(), confdir=work / "mitmconf",
                  sets=sets, log=work / f"mitmdump-{kind}.log", cwd=work) as px:
        call(px.url, model, 3)  # first contact: the proxy learns the version
        for _ in range(syncs):
            for _ in range(2):
                res["short_idle"].append(call(px.url, model, 3))
                p, v = next_version()
                res["idle"].append(proxy_sync(px.url, p, v)["seconds"]["total"])
        for _ in range(syncs):
            for _ in range(2):
                p, v = next_version()
                started, lat, out = threading.Event(), [], {}
                busy = threading.Thread(target=call, args=(px.url, model, busy_tokens, None, started, True))
                busy.start()
                started.wait(600)
                s = threading.Thread(target=lambda p=p, v=v, out=out: out.update(proxy_sync(px.url, p, v)))
                s.start()
                while httpx.get(px.url + "/polar/@weights").json()["state"] == "serving" and s.is_alive():
                    time.sleep(0.002)
                short = threading.Thread(target=call, args=(px.url, model, 3, lat))
                short.start()
                for t in (busy, s, short):
                    t.join()
                res["busy"].append(out["seconds"]["total"])
                res["delay"].append(lat[0] - statistics.median(res["short_idle"]))
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--syncs", type=int, default=5, help="sync pairs (perturbed, then original) per measurement")
    ap.add_argument("--servers", default="polar-serve,sglang,vllm")
    ap.add_argument("--vllm-url", default=None, help="a running real vLLM with VLLM_SERVER_DEV_MODE=1")
    ap.add_argument("--busy-tokens", type=int, default=40, help="tokens of the call in flight during a busy sync")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-wsync-"))
    orig = tiny_model()
    paths = [str(orig), str(perturbed_copy(orig, work / "perturbed", scale=0.2))]
    rows = []
    with ExitStack() as stack:
        for kind in a.servers.split(","):
            if kind == "vllm":
                url = a.vllm_url
                if url is None:
                    url = stack.enter_context(vllm(orig, env=DEV_MODE, log=work / "vllm.log")).url
            else:
                url = stack.enter_context(serve(orig, dialect="sglang" if kind == "sglang" else "vllm",
                                                model_name=None, log=work / f"serve-{kind}.log")).base_url
            r = bench_server(kind, url, work, paths, a.syncs, a.busy_tokens)
            rows.append((kind, r))
            print(f"{kind}: {r}", file=sys.stderr, flush=True)
    print(f"\n{a.syncs * 2} syncs each (tiny Qwen3, a perturbed copy and the original in turn); "
          f"medians in ms\n")
    print("| server | direct load | proxy, idle (hold) | ratio | proxy, call in flight (hold) | "
          "delay of a call arriving mid-sync |")
    print("|---|---|---|---|---|---|")
    for kind, r in rows:
        print(f"| {kind} | {r['direct'] * 1e3:.0f} | {r['idle'] * 1e3:.0f} | {r['idle'] / r['direct']:.2f} | "
              f"{r['busy'] * 1e3:.0f} | {r['delay'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
