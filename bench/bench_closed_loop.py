"""The closed loop's ablation matrix: every arm x every seed, real processes end to end
(harness_recipes/demo/closed_loop.py: polar-serve + mitmdump/addon + polar-recon watch + PolarGRPOTrainer).

    .venv/bin/python bench/bench_closed_loop.py [--seeds 0 1 2] [--arms real shuffled_rewards ...] [--steps 4]
        [--json OUT.json]

Seed s: sampling/trainer seed s and the tiny Qwen3 built with seed s (cache.tiny_model(s): seed 0 is the
default checkpoint). Every arm of a seed sees the same target, the same calibration, the same sampling
seeds and the same held-out episodes; only the arm's one transformation differs. Reported per run: the
training reward per iteration, training gain (mean of the last two iterations minus the first), held-out
reward before and after training, the IS ratio's clipped fraction, seconds. Margins of
tests/trainer/test_closed_loop.py are chosen from these numbers (docs/benchmarks/trainer.md).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("POLAR_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))  # the checkout's, as make

from harness_recipes.demo.closed_loop import ARMS, LoopConfig, run_closed_loop  # noqa: E402 (the project is installed: make install)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    out = []
    with tempfile.TemporaryDirectory(prefix="polar-bench-loop-") as tmp:
        for seed in a.seeds:
            first = None  # the seed's first arm calibrates and evaluates before training; the others reuse it
            for arm in a.arms:
                r = run_closed_loop(LoopConfig(Path(tmp) / f"s{seed}-{arm}", steps=a.steps, groups=a.groups,
                                               seed=seed, init_seed=seed, arm=arm,
                                               eval_samples=a.eval_samples, target=first and first.target,
                                               eval_before=first is None))
                if first is None:
                    first = r
                else:
                    r.heldout_before, r.calibration_fraction = first.heldout_before, first.calibration_fraction
                row = {"seed": seed, "arm": arm, "target": r.target, "calibrated": r.calibration_fraction,
                       "rewards": r.rewards, "train_gain": r.train_gain(), "heldout_before": r.heldout_before,
                       "heldout_after": r.heldout_after, "seconds": round(r.seconds, 1),
                       "is_clipped_frac": [s.get("importance_sampling_ratio/clipped_frac") for s in r.is_stats]}
                out.append(row)
                print(json.dumps(row), flush=True)
    print("\n| seed | arm | target | train reward per iteration | train gain | held-out before -> after | s |")
    print("|---|---|---|---|---|---|---|")
    for x in out:
        print(f"| {x['seed']} | {x['arm']} | {x['target']!r} | {[round(v, 2) for v in x['rewards']]} | "
              f"{x['train_gain']:+.2f} | {x['heldout_before']:.2f} -> {x['heldout_after']:.2f} | {x['seconds']:.0f} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
