"""Long episodes as real harnesses run them: a 100-call episode per bundled harness, measured.

    .venv/bin/python bench/bench_long_episodes.py                        # every bundled harness, 100 calls
    .venv/bin/python bench/bench_long_episodes.py --recipe pi --calls 30  # a quick one
    .venv/bin/python bench/bench_long_episodes.py --json                 # one JSON line

Same real stack as the compatibility matrix: polar-serve (scripted, the tiny Qwen3 with the real
tokenizer, CPU) <- mitmdump + Polar addon <- the real harness CLI run by polar-rollout. The script is
`long_script(calls)` (harness_recipes/long_episode.py): the fix, `calls - 3` shell calls that inspect
the workspace, the tests, the answer. Per harness: calls captured, wall time of the run,
`polar-recon build --check` of that episode alone (time, log and shard bytes, segments, rows, the
coverage ledger: trained share, closed or not), and a second build with `--max-len` (rows split at a
call boundary, calls longer alone left out and counted).

The baseline, side by side: the same harness through the same script at `--baseline-calls` (3: fix,
tests, answer) in the same run; the table gives the long episode's cost per call as a ratio of the
baseline's, so growth with length (every call's log row holds its whole prompt) shows as a ratio > 1.

Then the trainer consumes the long episodes once: every long log built into one GRPO group
(`--group-by status`: each harness ran its own task id, and every episode is `done`) with
`--max-len --split-len`, and one polar-train step on the CPU with `--shard_max_length` below the
longest row (default: the second-shortest episode's longest row, so at least two episodes stay and the
longer ones are excluded as too_long, counted in `polar/rows_excluded_too_long_total`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
os.environ.setdefault("POLAR_CACHE", str(ROOT / ".cache"))  # the checkout's cache (harnesses), as make

from harness_recipes.cache import tiny_model  # noqa: E402
from harness_recipes.long_episode import CALLS, build, no_call_fits, only_too_long, run_long, write_script  # noqa: E402
from harness_recipes.node.local_stack import capture_proxy, serve  # noqa: E402


def run_all(names: list[str], calls: int, base: Path, split_len: int | None, echo) -> tuple[dict, list[str]]:
    """{recipe: LongRun} of `calls`-call episodes, and the recipes that failed (with why)."""
    base.mkdir(parents=True, exist_ok=True)
    script = write_script(base / f"long-{calls}.json", calls)
    logdir = base / "logs"
    out, failed = {}, []
    with serve(tiny_model(), script=script, log=base / "serve.log") as srv, \
            capture_proxy(srv.url, logdir, log=base / "proxy.log") as proxy:
        for name in names:
            echo(f"[long] {name}: {calls} calls")
            try:
                out[name] = run_long(name, proxy, logdir, base, calls, echo=echo, split_len=split_len)
                echo(f"[long] {json.dumps(out[name].as_dict())}")
            except Exception as exc:  # noqa: BLE001 - one harness failing is a result, the others still run
                failed.append(f"{name}: {exc}"[:2000])
                echo(f"[long] {name} failed: {exc}"[:2000])
    return out, failed


def train_once(logdirs: list[Path], base: Path, split_len: int, max_length: int | None, echo) -> dict:
    """Build every log of `logdirs` (the long episodes, and the baseline's short ones, so that a
    group keeps two episodes when the longest are excluded) into one GRPO group with --max-len
    `split_len`, and take one polar-train step on the CPU with --shard_max_length `max_length`
    (default: one token less than the longest row the trainer could train, so that episode is
    excluded as too_long) and --temperature the rows' most common one. Returns what the step did."""
    from collections import Counter

    import pyarrow.parquet as pq

    logs = base / "train-logs"
    logs.mkdir(parents=True, exist_ok=True)
    for d in logdirs:
        for f in Path(d).glob("*.arrow"):
            (logs / f.name).hardlink_to(f)
    shards = base / "train-shards"
    b = build(logs, shards, "--max-len", str(split_len), group_by="status")
    no_row = sum(no_call_fits(ln) for ln in (b.stdout + b.stderr).splitlines() if ln.startswith("error:"))
    if b.returncode != 0 and not only_too_long(b):
        raise RuntimeError(f"polar-recon build for training failed: {b.stdout[-2000:]}{b.stderr[-2000:]}")
    rows = [r for s in sorted(shards.glob("*.parquet"))
            for r in pq.read_table(s, columns=["episode_id", "input_ids", "temperature"]).to_pylist()]
    temps = Counter(r["temperature"] for r in rows if r["temperature"])
    if not temps:
        raise RuntimeError("no row sampled at a temperature > 0: nothing the trainer can train")
    temperature = temps.most_common(1)[0][0]
    longest: dict[str, int] = {}
    per_ep: Counter = Counter()
    trainable = set()  # sampled at the trainer's temperature (others: excluded by the trainer, counted)
    for r in rows:
        e = r["episode_id"]
        longest[e] = max(longest.get(e, 0), len(r["input_ids"]))
        per_ep[e] += 1
        if r["temperature"] == temperature:
            trainable.add(e)
    if max_length is None:
        max_length = max(longest[e] for e in trainable) - 1
    kept = [e for e in trainable if longest[e] <= max_length]
    if len(kept) < 2:
        raise RuntimeError(f"--shard_max_length {max_length} leaves {len(kept)} episode(s): a GRPO group needs 2")
    kept_rows = sum(per_ep[e] for e in kept)
    g = 2
    n = math.ceil(kept_rows / g) * g  # the generation batch: the kept rows, in whole blocks of g
    echo(f"[train] {len(rows)} rows of {len(longest)} episodes; --temperature {temperature}: {len(trainable)} "
         f"episodes; --shard_max_length {max_length}: {len(kept)} episodes ({kept_rows} rows) fit")
    argv = ["--shards", str(shards), "--model", str(tiny_model()), "--output_dir", str(base / "ckpt"),
            "--max_steps", "1", "--num_generations", str(g), "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", str(n), "--shard_max_length", str(max_length),
            "--temperature", str(temperature),
            "--use_cpu", "--bf16", "false", "--gradient_checkpointing", "false", "--report_to", "none",
            "--save_strategy", "no", "--shard_wait_timeout", "30", "--disable_tqdm", "true", "--logging_steps", "1",
            "--torch_threads", "2",
            # polar-serve applies the generation_config's top_k/top_p; this step shows how the rows
            # are consumed (kept, excluded, counted), not the importance ratio
            "--vllm_importance_sampling_correction", "false"]
    code = ("import json, sys\nfrom trainer.train_grpo import train\nt = train(sys.argv[1:])\n"
            "logs = [h for h in t.state.log_history if 'polar/rows_excluded_too_long_total' in h]\n"
            "print('POLAR-STEP ' + json.dumps({'global_step': t.state.global_step, **(logs[-1] if logs else {})}))\n")
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    wall = time.perf_counter() - t0
    line = [x for x in p.stdout.splitlines() if x.startswith("POLAR-STEP ")]
    if p.returncode != 0 or not line:
        raise RuntimeError(f"polar-train failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-3000:]}")
    step = json.loads(line[-1].split(" ", 1)[1])
    return {"split_len": split_len, "episodes_without_rows": no_row, "temperature": temperature,
            "shard_max_length": max_length, "episodes": len(longest), "rows": len(rows),
            "longest_rows": dict(sorted(longest.items())), "episodes_fit": len(kept), "rows_fit": kept_rows,
            "global_step": step.get("global_step"), "wall_s": round(wall, 1),
            "metrics": {k: v for k, v in step.items() if k.startswith("polar/") and v
                        and ("excluded" in k or "groups" in k or "padded" in k)},
            "loss": step.get("loss")}


def table(long: dict, short: dict, calls: int, base_calls: int) -> str:
    head = ("| harness | status, reward | calls | wall s | recon s | log MB | shard KB | segments | rows | longest row | "
            "trained share | ledger | rows at --max-len | per call vs "
            f"{base_calls}-call: wall / recon / log bytes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in sorted(long.items()):
        b = short.get(name)

        def ratio(x, y, r=r, b=b):
            return f"{(x / r.calls) / (y / b.calls):.2f}x" if b and y else "n/a"
        per = " / ".join([ratio(r.wall_s, b.wall_s if b else 0), ratio(r.recon_s, b.recon_s if b else 0),
                          ratio(r.log_bytes, b.log_bytes if b else 0)])
        split = f"{r.split_rows} (trained {r.split_trained / r.sampled:.1%})" if r.split_rows is not None and r.sampled else "n/a"
        lines.append(f"| {name} | {r.status}, {r.reward} | {r.calls} ({r.auxiliary} aux) | {r.wall_s:.0f} | {r.recon_s:.1f} | "
                     f"{r.log_bytes / 2**20:.2f} | {r.shard_bytes / 1024:.0f} | {r.segments} | {r.rows} | {r.longest_row} | "
                     f"{r.trained_share:.1%} | {'closes' if r.closes else 'DOES NOT CLOSE'} | {split} | {per} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    from harness_recipes.recipes.recipe import bundled_names

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", action="append", help="harnesses to run (default: every bundled one)")
    ap.add_argument("--calls", type=int, default=CALLS)
    ap.add_argument("--baseline-calls", type=int, default=3)
    ap.add_argument("--split-len", type=int, default=4096, help="the second build's --max-len (and the training build's)")
    ap.add_argument("--max-length", type=int, default=None, help="the trainer's --shard_max_length")
    ap.add_argument("--no-train", action="store_true")
    ap.add_argument("--keep", type=Path, default=None, help="keep logs and shards here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = a.recipe or sorted(bundled_names())
    echo = (lambda m: print(m, file=sys.stderr, flush=True))
    with contextlib.ExitStack() as stack:
        base = a.keep or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="polar-long-")))
        short, short_failed = run_all(names, a.baseline_calls, base / f"c{a.baseline_calls}", None, echo)
        long, long_failed = run_all(names, a.calls, base / f"c{a.calls}", a.split_len, echo)
        train = None
        if not a.no_train:
            train = train_once([base / f"c{a.calls}" / "logs", base / f"c{a.baseline_calls}" / "logs"], base / "train",
                               a.split_len, a.max_length, echo)
    result = {"calls": a.calls, "baseline_calls": a.baseline_calls,
              "long": {k: v.as_dict() for k, v in long.items()}, "baseline": {k: v.as_dict() for k, v in short.items()},
              "failed": long_failed + short_failed, "train": train}
    if a.json:
        print(json.dumps(result))
        return
    print(table(long, short, a.calls, a.baseline_calls))
    for f in long_failed + short_failed:
        print("failed:", f)
    if train:
        print("train:", json.dumps(train))


if __name__ == "__main__":
    main()
