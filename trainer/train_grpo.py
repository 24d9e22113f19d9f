"""Train with GRPO on Polar shards as they land (``polar-train``).

    polar-train --shards OUT --model DIR --output_dir CKPT --max_steps 100 \
        [--num_generations 4 --per_device_train_batch_size 8 --learning_rate 1e-6 --temperature 1.0] \
        [--vllm_importance_sampling_mode sequence_mask --vllm_importance_sampling_clip_max 3.0] \
        [--max_policy_lag 2 --group_size_policy pad] \
        [--sync_server http://127.0.0.1:8080 --sync_steps 1 --sync_mode proxy --sync_secret_file FILE] \
        [--resume] [--config FILE.yaml]

Every GRPOConfig / TrainingArguments flag works (TrlParser, YAML via --config); the Polar fields are
PolarGRPOConfig's (grpo_config.py). ``--help`` lists Polar's options and the common TRL ones
(cli_help.py), ``--help-all`` every option. Several processes: ``accelerate launch --num_processes N -m
trainer.train_grpo ...``. What each option does and why: docs/training.md and docs/reference.md.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainer.grpo_config import PolarGRPOConfig
from trainer.grpo_trainer import PolarGRPOTrainer


@dataclass
class ScriptArguments:
    model: str = field(default=None, metadata={"help": "Hugging Face model directory of the policy."})
    resume: bool = field(default=False, metadata={"help": "Resume from the last checkpoint in --output_dir "
                                                           "(weights, optimizer and the shard cursor)."})
    torch_threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (CPU runs)."})


def looks_like_path(name: str) -> bool:
    """A --model that can only mean a local directory (a Hub repo id is NAME or ORG/NAME)."""
    return name.startswith(("/", ".", "~")) or name.endswith("/") or name.count("/") > 1


def load_policy(name: str, use_cpu: bool):
    """The policy model and tokenizer from --model, or a SystemExit that names the problem (not the Hub's
    "Repo id must be in the form ..." traceback for a mistyped directory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name).expanduser()
    if not path.exists() and looks_like_path(name):
        raise SystemExit(f"--model {name}: no such directory (give the Hugging Face model directory of the "
                         "policy: its config.json, weights and tokenizer)")
    if path.exists() and not (path / "config.json").is_file():
        raise SystemExit(f"--model {name}: not a Hugging Face model directory (no config.json in {path})")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path) if path.exists() else name,
                                                     dtype=torch.float32 if use_cpu else "auto")
        tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else name)
    except (OSError, ValueError) as exc:  # (huggingface_hub's HFValidationError is a ValueError)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"--model {name}: cannot load the policy (not a local model directory, and as a Hugging "
                         f"Face repo id: {first})") from None
    return model, tokenizer


def build(script, cfg):
    import torch

    if not script.model:
        raise SystemExit("--model DIR is required")
    if not cfg.shards:
        raise SystemExit("--shards OUT is required (a directory or filesystem URI that polar-recon writes)")
    if script.torch_threads:
        torch.set_num_threads(script.torch_threads)
    model, tokenizer = load_policy(script.model, cfg.use_cpu)
    return PolarGRPOTrainer(model=model, args=cfg, processing_class=tokenizer)


def parser():
    from trl import GRPOConfig, TrlParser

    p = TrlParser((ScriptArguments, PolarGRPOConfig))
    p.polar_short_help = lambda: _short_help(p, GRPOConfig)
    return p


def _short_help(p, base) -> str:
    from trainer.cli_help import short_help

    total = sum(1 for a in p._actions if a.option_strings and "--help" not in a.option_strings)
    return short_help(ScriptArguments, PolarGRPOConfig, base, total)


def train(argv: list[str] | None = None):
    """Parse the options, train, save; return the trainer (tests and callers that inspect the run)."""
    from trainer.cli_help import HELP_ALL

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is the documented hook we use
    args = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    if "-h" in args or "--help" in args:
        sys.stdout.write(p.polar_short_help())
        raise SystemExit(0)
    if HELP_ALL in args:
        args = ["--help"]  # TrlParser's full help, then argparse exits 0
    script, cfg = p.parse_args_and_config(args=args)
    trainer = build(script, cfg)
    trainer.train(resume_from_checkpoint=True if script.resume else None)
    trainer.save_model(cfg.output_dir)
    # trainer_state.json (its log_history: every logged metric per step) beside the model, also when
    # no checkpoint was saved: `polar-recon compare --trainer` draws the training curves from it.
    trainer.save_state()
    # The final cursor next to the final model, so a new run can start where this one stopped.
    trainer.shard_source.cursor.save(cfg.output_dir)
    return trainer


def main(argv: list[str] | None = None) -> int:
    """The console script: 0 after a successful run (its return value becomes the exit status)."""
    train(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
