"""A multi-harness run for `polar-recon compare` tests: real harness CLIs (pi, qwen-code, codex) on
the sample fix-add task through mitmdump + the Polar addon + scripted polar-serve, as
tests/rollout/test_real_harnesses.py runs them; each harness's `polar-rollout run` writes
ROOT/<harness>/ (rollout records, shards by `--recon build`, and its proxy's logs in logs/), the
layout of an experiment's store root (one store per harness, harness_recipes/fleet/experiment.py).

    python -m tests.recon.compare_stores ROOT   # builds it by hand (what the tests' fixture does)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "data" / "tasks"
SCRIPT = TASKS / "scripts" / "fix_tasks.json"
HARNESSES = ("pi", "qwen-code", "codex")


def build_stores(root: Path, harnesses=HARNESSES, samples: int = 2) -> Path:
    """Run every harness into ROOT/<harness> (its logs in ROOT/<harness>/logs); returns ROOT."""
    from harness_recipes.node.local_stack import capture_proxy, serve
    from harness_recipes.recipes.install import ensure_installed
    from harness_recipes.recipes.recipe import load_recipe
    from tests.support.servers import tiny_model_dir

    root = Path(root).resolve()  # the rollout resolves workspaces under OUT: relative paths break grading
    root.mkdir(parents=True, exist_ok=True)
    with serve(tiny_model_dir(), script=SCRIPT) as srv:
        for h in harnesses:
            ensure_installed(load_recipe(h))
            # its own proxy and logdir: `--recon build` builds every log of LOGDIR into the harness's OUT
            logdir = root / h / "logs"
            with capture_proxy(srv.url, logdir) as proxy:
                _rollout(root, h, proxy, logdir, samples)
    return root


def _rollout(root: Path, h: str, proxy, logdir: Path, samples: int) -> None:
    from harness_recipes.tasks.samples import sample_task_file
    proc = subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", h, "--tasks", str(sample_task_file(root, h)),
         "--samples", str(samples), "--concurrency", "1", "--proxy", proxy.url,
         "--control-secret-file", str(proxy.secret_file), "--logdir", str(logdir), "--out", str(root / h),
         "--no-progress", "--recon", "build"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"polar-rollout run --recipe {h} failed ({proc.returncode}):\n{proc.stderr[-3000:]}\n"
                           f"proxy:\n{proxy.output()[-2000:]}")

if __name__ == "__main__":
    print(build_stores(Path(sys.argv[1])))
