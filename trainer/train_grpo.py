"""Train with GRPO on Polar shards as they land (``polar-train``).

    polar-train --shards OUT --model DIR --output_dir CKPT --max_steps 100 \
        [--num_generations 4 --per_device_train_batch_size 8 --learning_rate 1e-6 --temperature 1.0] \
        [--vllm_importance_sampling_mode sequence_mask --vllm_importance_sampling_clip_max 3.0] \
        [--max_policy_lag 2 --group_size_policy pad] \
        [--sync_server http://127.0.0.1:8080 --sync_steps 1 --sync_mode proxy] [--resume] [--config FILE.yaml]

Every GRPOConfig / TrainingArguments flag works (TrlParser, YAML via --config); the Polar fields are
PolarGRPOConfig's (grpo_config.py). Several processes: ``accelerate launch --num_processes N -m
trainer.train_grpo ...``. What each option does and why: docs/training.md and docs/reference.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from trainer.grpo_config import PolarGRPOConfig
from trainer.grpo_trainer import PolarGRPOTrainer


@dataclass
class ScriptArguments:
    model: str = field(default=None, metadata={"help": "Hugging Face model directory of the policy."})
    resume: bool = field(default=False, metadata={"help": "Resume from the last checkpoint in --output_dir "
                                                           "(weights, optimizer and the shard cursor)."})
    torch_threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (CPU runs)."})


def build(script, cfg):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer


    if not script.model:
        raise SystemExit("--model DIR is required")
    if not cfg.shards:
        raise SystemExit("--shards OUT is required (a directory or filesystem URI that polar-recon writes)")
    if script.torch_threads:
        torch.set_num_threads(script.torch_threads)
    model = AutoModelForCausalLM.from_pretrained(script.model, dtype=torch.float32 if cfg.use_cpu else "auto")
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    return PolarGRPOTrainer(model=model, args=cfg, processing_class=tokenizer)


def main(argv: list[str] | None = None):
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is the documented hook we use
    from trl import TrlParser


    script, cfg = TrlParser((ScriptArguments, PolarGRPOConfig)).parse_args_and_config(args=argv)
    trainer = build(script, cfg)
    trainer.train(resume_from_checkpoint=True if script.resume else None)
    trainer.save_model(cfg.output_dir)
    # trainer_state.json (its log_history: every logged metric per step) beside the model, also when
    # no checkpoint was saved: `polar-recon compare --trainer` draws the training curves from it.
    trainer.save_state()
    # The final cursor next to the final model, so a new run can start where this one stopped.
    trainer.shard_source.cursor.save(cfg.output_dir)
    return trainer


if __name__ == "__main__":
    main()
