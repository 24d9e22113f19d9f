"""Benchmark polar-serve on the tiny Qwen3: generation tokens/s, short-call requests/s, and the
latency of a replayed ~17k-token harness request (cold and with the prefix cache warm).

    .venv/bin/python bench/bench_serve.py [--dialect vllm] [--tokens 200] [--requests 40]

Prints a markdown table. Starts its own server (a subprocess on 127.0.0.1) and stops it by pid.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("POLAR_CACHE", str(REPO / ".cache"))  # the checkout's cache, as `make` and the tests use

from harness_recipes.cache import tiny_model  # noqa: E402
from harness_recipes.node.local_stack import serve  # noqa: E402


def _chat(base, body):
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def bench(dialect: str, n_tokens: int, n_requests: int, threads: int) -> list[tuple[str, str]]:
    rows = []
    script = REPO / "tests" / "serve" / "data" / "script_with_sampling.json"
    with serve(tiny_model(), script, dialect, model_name="fake-model", extra_args=["--threads", str(threads)]) as srv:
        base = srv.base_url
        sample = {"model": "fake-model", "messages": [{"role": "user", "content": "POLAR-SAMPLE write"}],
                  "ignore_eos": True, "temperature": 0.8, "seed": 0}
        _chat(base, dict(sample, max_tokens=4))  # warm-up
        t = time.perf_counter()
        d = _chat(base, dict(sample, max_tokens=n_tokens))
        dt = time.perf_counter() - t
        n = d["usage"]["completion_tokens"]
        rows.append((f"generation, {n} tokens (short prompt, top_k 20/top_p 0.95 defaults)", f"{n / dt:.0f} tokens/s"))
        t = time.perf_counter()
        for i in range(n_requests):
            _chat(base, dict(sample, max_tokens=1, seed=i))
        dt = time.perf_counter() - t
        rows.append((f"short calls (max_tokens 1), {n_requests} sequential", f"{n_requests / dt:.1f} requests/s"))
        bodies = [json.loads(x)["body"] for x in (REPO / "tests/fixtures/harness-requests/qwen-code.jsonl")
                  .read_text().splitlines()]
        for b in bodies:
            b["stream"] = False
            b.pop("stream_options", None)
        plen = len(httpx.post(base + "/tokenize", json={"messages": bodies[0]["messages"], "tools": bodies[0]["tools"]},
                              timeout=60).json()["tokens"])
        # Cold: a fresh prompt (a changed system message defeats the prefix cache).
        cold = json.loads(json.dumps(bodies[0]))
        cold["messages"][0]["content"] = "bench " + str(time.time()) + "\n" + str(cold["messages"][0]["content"])
        t = time.perf_counter()
        d = _chat(base, cold)
        rows.append((f"scripted harness call, ~{plen} prompt tokens, cold", f"{time.perf_counter() - t:.2f} s "
                     f"({d['usage']['completion_tokens']} tokens teacher-forced)"))
        for i, b in enumerate(bodies):
            t = time.perf_counter()
            d = _chat(base, b)
            rows.append((f"scripted harness call {i} (prefix cache warm where shared)", f"{time.perf_counter() - t:.2f} s"))
        long = dict(sample, messages=cold["messages"], tools=cold["tools"], max_tokens=50)
        long["messages"] = long["messages"][:-1] + [{"role": "user", "content": "POLAR-SAMPLE go"}]
        t = time.perf_counter()
        d = _chat(base, long)
        rows.append((f"sampled: ~{d['usage']['prompt_tokens']} prompt tokens (warm prefix) + 50 generated",
                     f"{time.perf_counter() - t:.2f} s"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dialect", default="vllm", choices=("vllm", "sglang"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    rows = bench(a.dialect, a.tokens, a.requests, a.threads)
    load = os.getloadavg()[0]
    print(f"\npolar-serve ({a.dialect}), tiny Qwen3 (hidden 64, 2 layers), {a.threads} torch threads, "
          f"{os.cpu_count()} CPUs, load average {load:.1f}\n")
    print("| measurement | result |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
