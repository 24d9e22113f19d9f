"""The closed sets of values PolarGRPOConfig accepts, defined once and imported by both the config
(trainer/grpo_config.py) and the modules that act on them, so the config stays a leaf: it needs no
rollout, correction or sync module to validate a field."""
from __future__ import annotations

# trainer/shard_rollout.py: how groups whose row count differs from num_generations are laid out.
GROUP_SIZE_POLICIES = ("pad", "skip")
# trainer/is_correction.py: TRL's four vLLM importance-sampling modes (same names, same semantics).
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# trainer/grpo_trainer.py: what realigned rows below the realign gate get.
REALIGN_IS = ("correct", "exempt")
# trainer/behaviour_logprobs.py (cut_dtype): the precisions a server's logits may have when it makes its
# top_k/top_p/min_p cuts, which the trainer then makes on its own logits rounded to it.
SERVER_LOGITS_DTYPES = ("bfloat16", "float16")
# trainer/weight_sync.py: how weights reach the server.
SYNC_MODES = ("polar", "proxy", "vllm_lora", "fleet")
