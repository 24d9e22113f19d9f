"""Run under ``accelerate launch --num_processes 2 --cpu`` by test_ranks.py: one PolarGRPOTrainer per
rank on the same shard directory. Writes OUT/rank<R>.json: the groups each rank took from its source
(``taken``), the groups of each batch it trained (``trained``), its cursor, its version history and dropped
groups, and the error it stopped with. An optional 6th argument: JSON of PolarGRPOConfig fields to override."""
from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(shards: str, out: str, model_dir: str, max_steps: int, wait: float, overrides: dict | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.grpo_config import PolarGRPOConfig
    from trainer.grpo_trainer import PolarGRPOTrainer

    torch.set_num_threads(1)
    trained: list[list[str]] = []

    class Recorder(PolarGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            trained.append(sorted({x["group_id"] for x in inputs if not x["polar_pad"]}))
            return output

    kw = dict(
        output_dir=out, shards=shards, max_steps=max_steps, per_device_train_batch_size=2, num_generations=2,
        learning_rate=1e-3, logging_steps=1, save_strategy="steps", save_steps=2, report_to="none", use_cpu=True,
        bf16=False, shard_wait_timeout=wait, shard_poll_interval=0.1, seed=0, disable_tqdm=True,
        vllm_importance_sampling_correction=False)
    cfg = PolarGRPOConfig(**{**kw, **(overrides or {})})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    t = Recorder(model=model, args=cfg, processing_class=AutoTokenizer.from_pretrained(model_dir))
    src = t.shard_source
    taken: list[str] = []
    inner = src.try_next

    def try_next():
        g = inner()
        if g is not None:
            taken.append(g.group_id)
        return g

    src.try_next = try_next
    error = None
    try:
        t.train()
    except Exception as e:  # the test checks which error every rank stopped with
        error = f"{type(e).__name__}: {e}"
        traceback.print_exc()
    report = {"rank": src.rank, "world_size": src.world_size, "taken": taken, "trained": trained,
              "cursor": json.loads(src.cursor.to_json()), "error": error, "steps": t.state.global_step,
              "history": src.versions.history, "dropped": dict(src.stats.dropped)}
    (Path(out) / f"rank{src.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]),
         json.loads(sys.argv[6]) if len(sys.argv) > 6 else None)
