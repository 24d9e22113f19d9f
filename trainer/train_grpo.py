"""Train with GRPO on Polar shards as they land.

    polar-train --shards OUT --model DIR --output_dir CKPT --max_steps 100 \
        [--num_generations 4 --per_device_train_batch_size 8 --learning_rate 1e-6 --temperature 1.0] \
        [--vllm_importance_sampling_mode sequence_mask --vllm_importance_sampling_clip_max 3.0] \
        [--max_policy_lag 2 --group_size_policy pad] \
        [--sync_server http://127.0.0.1:8000 --sync_steps 1 --sync_mode polar] [--resume] [--config FILE.yaml]

Every GRPOConfig / TrainingArguments flag works (TrlParser, YAML via --config). Set --temperature to the
sampling temperature of the server, or the importance ratios compare different distributions: every
group is checked (shards record the temperature the server applied, e.g. 0.6 for Qwen3's
generation_config.json) and a mismatch stops training with the value to pass.

Importance sampling (on by default, TRL's ``vllm_importance_sampling_*`` flags): the old policy's
log-probs are taken under each row's recorded sampling transform (temperature, then min_p/top_k/top_p
in vLLM's order for ``processed`` logprobs; temperature only for SGLang's ``scaled``), so truncated
sampling gives ratio 1 on-policy. Rows with ``raw`` or unknown logprobs stop training with the fix
(``vllm serve ... --logprobs-mode processed_logprobs``); rows whose sampling cannot be reproduced
(``sampling_unsupported``: penalties, logit_bias, ...) are excluded with their episode, counted and
logged. ``--vllm_importance_sampling_correction false`` trains on any rows without the correction.

Advantages are per episode (grpo.py); groups are never cut for their segments; ``--shard_max_length``
(default: the model's max_position_embeddings) excludes longer episodes, counted; ``--mask_truncated_completions``
uses the shards' ``termination``. Several processes: ``accelerate launch --num_processes N -m trainer.train_grpo
...``: each rank trains its own partition of the groups and checkpoints its own cursor.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class ScriptArguments:
    model: str = field(default=None, metadata={"help": "Hugging Face model directory of the policy."})
    resume: bool = field(default=False, metadata={"help": "Resume from the last checkpoint in --output_dir "
                                                           "(weights, optimizer and the shard cursor)."})
    torch_threads: int | None = field(default=None, metadata={"help": "torch.set_num_threads (CPU runs)."})


def build(script, cfg):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.grpo_trainer import PolarGRPOTrainer

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

    from trainer.grpo_config import PolarGRPOConfig

    script, cfg = TrlParser((ScriptArguments, PolarGRPOConfig)).parse_args_and_config(args=argv)
    trainer = build(script, cfg)
    trainer.train(resume_from_checkpoint=True if script.resume else None)
    trainer.save_model(cfg.output_dir)
    # The final cursor next to the final model, so a new run can start where this one stopped.
    trainer.shard_source.cursor.save(cfg.output_dir)
    return trainer


if __name__ == "__main__":
    main()
