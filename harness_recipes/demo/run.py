"""`make demo`: the whole loop on a fresh machine, on the CPU, in a few minutes.

1. install the harness CLI (Pi by default) into the harness cache (cache.py; .cache/ under make)
2. build the tiny random Qwen3 (real tokenizer and chat template) into the cache
3. start the inference server, scripted (data/tasks/scripts/fix_tasks.json makes the random tiny
   model fix the sample tasks), and mitmdump with the Polar addon in front of it:
   - `--server vllm` (default, `make demo`): the REAL vLLM 0.32 (CPU build, `make vllm`) with the
     ForcedReply logits processor, behind the scripting shim that passes each scripted reply as
     token ids in `vllm_xargs` (harness_recipes/demo/forced_replies.py): vLLM samples the forced tokens
     and reports the model's own logprobs of them. Started with `--generation-config vllm`
     (temperature 1, no top-k/top-p) and `--logprobs-mode raw_logprobs` (not the project's
     processed default, local_stack.VLLM_FLAGS: processed logprobs come after the forcing processor, 0.0
     for every forced token); at temperature 1 without truncation raw logprobs are the processed
     ones of the model's own distribution, and the trainer's temperature 1 is the one they were
     computed at. The capture proxy runs with polar_generation_config=none (what the server applies).
   - `--server polar-serve` (`make demo SERVER=polar-serve`): polar-serve's scripted mode, our CPU
     stand-in, which starts in seconds instead of ~2 minutes.
4. polar-rollout: the real harness CLI on the bundled sample tasks (data/tasks/), 2 samples per
   task, pipelined
5. polar-recon build: token-faithful shards
6. a few GRPO steps with polar-train (trainer/train_grpo.py) on those shards
7. polar-recon compare: the run's report (terminal table; OUT/report.html with plots, training
   curves from the trainer's trainer_state.json, and token views of the episodes it names)
8. a summary: episodes, rewards, trainable tokens, where the files are

    python -m harness_recipes.demo [--server vllm|polar-serve] [--harness pi|qwen-code|codex|claude-code]
                                   [--out runs/demo]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from harness_recipes.cache import harness_cache, tiny_model
from harness_recipes.demo.scripted_vllm import scripted_vllm
from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.recipes.install import ensure_installed, installed_version
from harness_recipes.recipes.recipe import load_recipe
from polar_contracts.assets import data_path
from trainer.row_temperature import generation_default, logprob_temperature

TASKS = data_path("tasks", "tasks.jsonl")
SCRIPT = data_path("tasks", "scripts", "fix_tasks.json")


def step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def run(cmd: list[str], timeout: float) -> None:
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"demo: command failed with exit {proc.returncode}: {' '.join(cmd)}")


def rollout(harness: str, proxy, logdir: Path, out: Path, samples: int) -> None:
    """polar-rollout through the capture proxy (its Proc: the URL and the control secret's file)."""
    run([sys.executable, "-m", "harness_recipes.cli", "run", "--recipe", harness, "--tasks", str(TASKS),
         "--samples", str(samples), "--proxy", proxy.url, "--control-secret-file", str(proxy.secret_file),
         "--logdir", str(logdir), "--out", str(out),
         "--concurrency", "2", "--prewarm", "2", "--recon", "none"], timeout=1800)


def served_default_temperature(server: str, model: Path) -> float:
    """The temperature the server applies to requests that set none: polar-serve, the model's
    generation_config.json default, as vLLM does by default; our vLLM runs `--generation-config vllm`
    (vLLM's neutral defaults: 1.0)."""

    return 1.0 if server == "vllm" else generation_default(model)


def sampling_temperature(shards: Path, default: float) -> float:
    """The temperature the server sampled the shards with: what the harness's requests asked for,
    else (Pi asks for none) the server's default for requests without one. The trainer must
    compute its logprobs at it; it checks every group (trainer/row_temperature.py)."""
    import polars as pl


    temps = pl.read_parquet(shards / "shard-*.parquet", columns=["temperature"])["temperature"].to_list()
    found = sorted({logprob_temperature(t, default) for t in temps})
    if len(found) != 1:
        raise SystemExit(f"demo: the shards were sampled at several temperatures {found}; one run trains one")
    return found[0]


def train(model: Path, shards: Path, ckpt: Path, samples: int, steps: int, served_default: float) -> None:
    temperature = sampling_temperature(shards, served_default)
    print(f"sampling temperature {temperature:g} (the trainer's logprobs use the same)", flush=True)
    # polar-train's default importance sampling (token_truncate, clip 3.0): with the trainer at the
    # server's temperature the ratios are ~1, so no demo token is lost.
    run([sys.executable, "-m", "trainer.train_grpo", "--model", str(model), "--shards", str(shards),
         "--output_dir", str(ckpt), "--max_steps", str(steps), "--num_generations", str(samples),
         "--per_device_train_batch_size", str(samples), "--learning_rate", "1e-5", "--logging_steps", "1",
         "--use_cpu", "true", "--bf16", "false", "--report_to", "none", "--save_strategy", "no",
         "--gradient_checkpointing", "false", "--shard_wait_timeout", "60", "--torch_threads", "2",
         "--temperature", f"{temperature:g}", "--served_default_temperature", f"{served_default:g}"], timeout=1800)


def summary(out: Path, logdir: Path, shards: Path, ckpt: Path, wall: float) -> dict:
    import polars as pl
    recs = [json.loads(x) for x in (out / "rollout" / "episodes.jsonl").read_text().splitlines()]
    df = pl.read_parquet(shards / "shard-*.parquet")
    trainable = int(sum(sum(m) for m in df["loss_mask"].to_list()))
    info = {
        "episodes": len(recs),
        "statuses": {s: sum(r["status"] == s for r in recs) for s in sorted({r["status"] for r in recs})},
        "mean_reward": round(sum(r["reward"] for r in recs) / max(len(recs), 1), 3),
        "rewards_by_group": {g: [r["reward"] for r in recs if r["group_id"] == g] for g in sorted({r["group_id"] for r in recs})},
        "model_calls": sum(r.get("n_calls", 0) for r in recs),
        "sequences": df.height,
        "tokens": int(sum(len(x) for x in df["input_ids"].to_list())),
        "trainable_tokens": trainable,
        "capture_logs": str(logdir),
        "shards": str(shards),
        "rollout_records": str(out / "rollout" / "episodes.jsonl"),
        "checkpoint_dir": str(ckpt),
        "wall_seconds": round(wall, 1),
    }
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", choices=("vllm", "polar-serve"), default="vllm",
                    help="the inference server: the real vLLM (default; `make vllm` builds it) or polar-serve, "
                    "our faster CPU stand-in; both scripted")
    ap.add_argument("--harness", default="pi", help="recipe name (default pi: the quickest on a CPU)")
    ap.add_argument("--out", default="runs/demo", help="where everything is written (default: runs/demo here)")
    ap.add_argument("--samples", type=int, default=2, help="episodes per task (the GRPO group size)")
    ap.add_argument("--steps", type=int, default=None, help="GRPO optimizer steps (default: one per task group)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    base = Path(args.out).resolve()
    if base.exists():
        shutil.rmtree(base)  # a demo starts clean; real runs resume instead (polar-rollout run)
    logdir, out, shards, ckpt = base / "logs", base, base / "shards", base / "ckpt"

    step(f"install the {args.harness} harness CLI ({harness_cache()})")
    recipe = load_recipe(args.harness)
    ensure_installed(recipe)
    print(f"{recipe.name}: {installed_version(recipe)}")
    step("build the tiny Qwen3 model (real tokenizer + chat template, random weights)")
    model = tiny_model()
    print(model)
    with contextlib.ExitStack() as stack:
        if args.server == "vllm":
            step("start the real vLLM (ForcedReply logits processor; ~2 minutes on a CPU), the scripting shim "
                 "and mitmdump with the Polar addon")
            srv = stack.enter_context(scripted_vllm(model, SCRIPT,
                                                    extra_args=["--generation-config", "vllm",
                                                                "--logprobs-mode", "raw_logprobs"],
                                                    record=base / "forced.jsonl", vllm_log=base / "vllm.log",
                                                    shim_log=base / "shim.log"))
            where = f"vLLM {srv.vllm.url} (log {base / 'vllm.log'})  <-  scripting shim {srv.url}"
        else:
            step("start polar-serve (scripted) and mitmdump with the Polar addon")
            srv = stack.enter_context(serve(model, script=SCRIPT))
            where = f"polar-serve {srv.url}"
        # the sampling defaults the server applies to unset fields (rows record them; addon/applied_sampling.py)
        gen = "none" if args.server == "vllm" else str(model)
        proxy = stack.enter_context(capture_proxy(srv.url, logdir, sets={"polar_generation_config": gen}))
        print(f"{where}  <-  mitmdump {proxy.url}  (logs: {logdir})")
        step(f"polar-rollout: {recipe.name} on {TASKS}, {args.samples} samples per task")
        rollout(recipe.name, proxy, logdir, out, args.samples)
    step("polar-recon build: token-faithful shards")
    run([sys.executable, "-m", "polar_recon.cli", "build", str(logdir), str(shards),
         "--group-size", str(args.samples)], timeout=600)
    steps = args.steps or len(TASKS.read_text().splitlines())  # one group per task: each gets a step
    step(f"GRPO: {steps} steps with TRL on the shards")
    train(model, shards, ckpt, args.samples, steps, served_default_temperature(args.server, model))
    step("polar-recon compare: the report of this run (terminal table; HTML with plots and token views)")
    run([sys.executable, "-m", "polar_recon.cli", "compare", str(base), "--trainer", str(ckpt),
         "--html", str(base / "report.html")], timeout=600)
    info = {"server": args.server, **summary(out, logdir, shards, ckpt, time.monotonic() - t0),
            "report": str(base / "report.html")}
    step("summary")
    for k, v in info.items():
        print(f"  {k:18} {v}")
    (base / "summary.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
