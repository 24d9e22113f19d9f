"""``polar-train --help``: Polar's own options first, then the TRL options a run usually sets.

TrlParser's own help lists every TrainingArguments / GRPOConfig flag (well over a thousand lines) with
Polar's options near the end; the short help is read from the same dataclass fields, so it cannot
drift from what the parser accepts. ``--help-all`` prints TrlParser's full help.
"""
from __future__ import annotations

import dataclasses
import textwrap

# TRL / transformers flags most polar-train runs set (docs/reference.md#polar-train, docs/training.md)
COMMON_TRL = ("output_dir", "max_steps", "num_generations", "per_device_train_batch_size",
              "gradient_accumulation_steps", "learning_rate", "temperature", "beta", "loss_type",
              "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max", "save_steps", "logging_steps",
              "report_to", "logging_dir", "use_cpu", "bf16", "gradient_checkpointing", "seed")

HELP_ALL = "--help-all"


def _entry(f: dataclasses.Field) -> str:
    default = f.default if f.default is not dataclasses.MISSING else (
        "..." if f.default_factory is dataclasses.MISSING else f.default_factory())
    text = " ".join(str(f.metadata.get("help", "")).split())
    head = f"  --{f.name} (default: {default})"
    return head + ("\n" + textwrap.fill(text, 100, initial_indent=" " * 6, subsequent_indent=" " * 6) if text else "")


def short_help(script_cls, config_cls, base_cls, total_options: int) -> str:
    """The help text: script options, the config's own fields (those ``base_cls`` lacks), COMMON_TRL."""
    base = {f.name for f in dataclasses.fields(base_cls)}
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    own = [f for f in dataclasses.fields(config_cls) if f.name not in base]
    parts = ["usage: polar-train --shards OUT --model DIR --output_dir CKPT --max_steps N [options]",
             "",
             "Train with GRPO on Polar shards as they land. Every option also reads from --config FILE.yaml.",
             "",
             "polar-train:",
             *(_entry(f) for f in dataclasses.fields(script_cls)),
             "",
             "Polar (PolarGRPOConfig, trainer/grpo_config.py):",
             *(_entry(f) for f in own),
             "",
             "Common TRL options (GRPOConfig / TrainingArguments):",
             *(_entry(fields[n]) for n in COMMON_TRL if n in fields),
             "",
             f"{HELP_ALL}: all {total_options} options (TRL's and transformers' included). Every option, "
             "what it does and why: docs/reference.md#polar-train."]
    return "\n".join(parts) + "\n"
