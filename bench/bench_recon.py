"""Benchmark: `polar-recon build` against the floor of merely reading the same logs with pyarrow.

    .venv/bin/python bench/bench_recon.py                      # 1,000 episodes x 30 calls, prompts to 32k
    .venv/bin/python bench/bench_recon.py --episodes 50        # a quick run
    .venv/bin/python bench/bench_recon.py --json               # one JSON line (for scripts/tests)

Synthetic logs with the ChatML turn structure of the Qwen3 template (system turn, tool turns, the
generation prompt `<|im_start|>assistant\\n`, completions ending `<|im_end|>`), written with the
real EpisodeWriter from numpy arrays. Each completion opens with a <think> block; one call in three
re-renders the previous assistant turn without it (as the Qwen3 template drops earlier thinking), so
REALIGN links (a known re-render class, decoded and classified) are on the path.

Each phase runs in its own fresh interpreter, one after the other on the same files (page cache
warm for both, read once beforehand); time is measured around the work only, and peak memory is the
process's max RSS minus its RSS after imports.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

IM_START, IM_END, NL, ASSISTANT, USER, SYSTEM = 151644, 151645, 198, 77091, 872, 8948
THINK, END_THINK, NL2 = 151667, 151668, 271


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_logs(logdir: Path, episodes: int, calls: int, max_prompt: int, seed: int = 0) -> dict:
    from polar_contracts.log.writer import EpisodeWriter

    rng = np.random.default_rng(seed)
    logdir.mkdir(parents=True, exist_ok=True)
    first = 2000
    comp_len = 150
    per_turn = max(8, (max_prompt - first) // max(1, calls - 1) - comp_len)  # tool result tokens per turn
    t0 = time.perf_counter()
    n_tokens = 0
    for e in range(episodes):
        eid = f"bench-{e:05d}"
        w = EpisodeWriter(logdir / f"{eid}.arrow", eid)
        words = lambda n: rng.integers(0, 150000, n, dtype=np.int32)  # noqa: E731  (no special ids)
        prompt = np.concatenate([[IM_START, SYSTEM, NL], words(first - 8),
                                 [IM_END, NL, IM_START, ASSISTANT, NL]]).astype(np.int32)
        for c in range(calls):
            comp = np.concatenate([[THINK, NL], words(8), [NL, END_THINK, NL2], words(comp_len - 14),
                                   [IM_END]]).astype(np.int32)
            lps = -rng.exponential(0.5, comp_len).astype(np.float32)
            w.append_call(call_index=c, prompt_ids=prompt, completion_ids=comp, completion_logprobs=lps,
                          api="chat", dialect="vllm", model="bench", status=200, stream=True,
                          t_start=float(c), t_end=float(c) + 0.5, finish_reason="stop", weight_version="1")
            n_tokens += len(prompt) + len(comp)
            # the harness resends the turn: every third time re-rendered without its think block
            turn = comp[13:] if c % 3 == 2 else comp
            tool = np.concatenate([[NL, IM_START, USER, NL], words(per_turn), [IM_END, NL, IM_START, ASSISTANT, NL]])
            prompt = np.concatenate([prompt, turn, tool]).astype(np.int32)
        w.end(float(rng.random()), {"group_id": f"task-{e // 8}"})
    return {"episodes": episodes, "calls": calls, "final_prompt_tokens": int(len(prompt)),
            "call_tokens": n_tokens, "generate_s": time.perf_counter() - t0,
            "bytes_on_disk": sum(p.stat().st_size for p in logdir.iterdir())}


def phase_read(logdir: Path) -> dict:
    """The floor: read every log's record batches with pyarrow, nothing else (packed payloads stay packed)."""
    import pyarrow as pa

    base = _rss_mb()
    t0 = time.perf_counter()
    rows = nbytes = 0
    for p in sorted(logdir.glob("*.arrow")):
        t = pa.ipc.open_stream(pa.memory_map(str(p), "r")).read_all()
        rows += t.num_rows
        nbytes += t.nbytes
    return {"seconds": time.perf_counter() - t0, "rows": rows, "table_bytes": nbytes,
            "peak_mb_over_base": _peak_mb() - base}


def phase_build(logdir: Path, out: Path, strategy: str) -> dict:
    from polar_recon.build import Options, build

    base = _rss_mb()
    t0 = time.perf_counter()
    r = build(logdir, out, Options(strategy=strategy, shard_size=64))
    return {"seconds": time.perf_counter() - t0, "episodes": len(r.built), "sequences": r.sequences,
            "sequence_tokens": r.tokens, "trainable_tokens": r.trainable, "errors": len(r.errors),
            "shards": len(r.shards), "peak_mb_over_base": _peak_mb() - base,
            # the coverage ledger (polar_recon/ledger.py): every sampled token trained or excluded
            "ledger": r.ledger.to_json(), "ledger_summary": r.ledger.summary()}


def drift_sim(work: Path, episodes: int) -> dict:
    """`polar-recon drift` on episodes rendered with the real Qwen3 template by the simulated
    harness habits of polar_recon.testing (reasoning resent or dropped, whitespace content resent,
    compact arguments), thinking on, three tool turns each: the retokenize baseline's error per habit."""
    import random

    from click.testing import CliRunner

    from polar_recon import testing as L
    from polar_recon.cli import main as cli

    rnd = random.Random(0)
    results = {}
    for harness in ("strict", "tidy", "qwen-code", "pi"):
        logdir = work / f"drift-{harness}"
        logdir.mkdir(parents=True, exist_ok=True)
        for e in range(episodes):
            def run(c):
                for t in range(3):
                    reasoning = rnd.choice(["", "I will use the tool.", "Check the file first."])
                    content = rnd.choice(["", "Let me do that.", ""])
                    c.call(L.Sample(reasoning, content, [L.write_tool(f"f{t}.txt", "x" * t)]), results=["ok"])
                c.call(L.Sample(rnd.choice(["", "Done."]), "All files written.", []))
            L.episode(logdir, f"{harness}-{e}", run, harness=harness, metadata={"harness": harness}, seed=e)
        r = CliRunner().invoke(cli, ["drift", str(logdir), "--json"], catch_exceptions=False)
        results[harness] = json.loads(r.output.strip().splitlines()[-1])
    return results


def _run_phase(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--phase", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--max-prompt", type=int, default=32000)
    ap.add_argument("--strategy", default="token")
    ap.add_argument("--dir", help="work dir (kept); default: a temporary dir, removed")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--drift-sim", type=int, metavar="N",
                    help="instead: drift of N simulated episodes per harness habit (polar_recon.testing)")
    ap.add_argument("--phase", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.drift_sim:
        with tempfile.TemporaryDirectory(prefix="drift-sim-") as d:
            res = drift_sim(Path(d), a.drift_sim)
        if a.json:
            print(json.dumps(res))
            return
        print(f"{'habit':12}{'trainable':>10}{'differ':>8}{'share':>8}{'seqs hit':>10}  links")
        for h, r in res.items():
            links = ", ".join(f"{k} {v}" for k, v in r["links_by_harness"][h].items())
            print(f"{h:12}{r['trainable_tokens']:>10}{r['retokenize_differing_tokens']:>8}"
                  f"{100 * r['retokenize_differing_share']:>7.1f}%"
                  f"{r['retokenize_sequences_affected']:>6}/{r['sequences']:<4} {links}")
        return
    if a.phase:
        kind, *rest = a.phase
        res = phase_read(Path(rest[0])) if kind == "read" else phase_build(Path(rest[0]), Path(rest[1]), rest[2])
        print(json.dumps(res))
        return
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench-recon-"))
    try:
        logs = work / "logs"
        if logs.exists():
            shutil.rmtree(logs)
        if (work / "out").exists():
            shutil.rmtree(work / "out")
        gen = make_logs(logs, a.episodes, a.calls, a.max_prompt)
        _run_phase(["read", str(logs)])  # warm the page cache
        floor = _run_phase(["read", str(logs)])
        built = _run_phase(["build", str(logs), str(work / "out"), a.strategy])
        res = {"generate": gen, "read_floor": floor, "build": built,
               "build_over_floor": built["seconds"] / floor["seconds"] if floor["seconds"] else None,
               "call_tokens_per_s": gen["call_tokens"] / built["seconds"],
               "sequence_tokens_per_s": built["sequence_tokens"] / built["seconds"]}
        if a.json:
            print(json.dumps(res))
            return
        print(f"logs: {gen['episodes']} episodes x {gen['calls']} calls, prompts to {gen['final_prompt_tokens']} tokens, "
              f"{gen['call_tokens'] / 1e6:.1f}M tokens in calls, {gen['bytes_on_disk'] / 2**20:.0f} MiB on disk "
              f"(generated in {gen['generate_s']:.1f}s)")
        print(f"{'':24}{'seconds':>10}{'M call tok/s':>14}{'peak MiB':>10}")
        for name, r in (("read with pyarrow", floor), (f"build ({a.strategy})", built)):
            print(f"{name:24}{r['seconds']:>10.2f}{gen['call_tokens'] / r['seconds'] / 1e6:>14.1f}"
                  f"{r['peak_mb_over_base']:>10.0f}")
        print(f"build / floor = {res['build_over_floor']:.2f}x; build wrote {built['sequences']} sequences, "
              f"{built['sequence_tokens'] / 1e6:.1f}M tokens ({res['sequence_tokens_per_s'] / 1e6:.1f}M/s), "
              f"{built['trainable_tokens'] / 1e6:.2f}M trainable, {built['shards']} shards")
        print(f"ledger: {built['ledger_summary']}")
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
