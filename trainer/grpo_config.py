"""PolarGRPOConfig: TRL's GRPOConfig plus the shard stream, the weight sync and the sampling checks
(kept apart from the trainer, as TRL keeps grpo_config.py apart from grpo_trainer.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from trainer.config_choices import GROUP_SIZE_POLICIES, IS_MODES, REALIGN_IS, SERVER_LOGITS_DTYPES, SYNC_MODES
from trainer.cpu_fallback import fall_back_to_cpu


@dataclass
class PolarGRPOConfig(GRPOConfig):
    """GRPOConfig plus the shard stream. Importance sampling reuses TRL's own fields
    ``vllm_importance_sampling_correction`` (default True), ``vllm_importance_sampling_mode``
    (token_truncate | token_mask | sequence_truncate | sequence_mask; default token_truncate here, where
    TRL's is sequence_mask: docs/training.md says why), ``vllm_importance_sampling_clip_max`` (3.0) and
    ``vllm_importance_sampling_clip_min`` (None), applied to the recorded behaviour logprobs with
    ``use_vllm=False``."""

    # A sequence ratio multiplies every token's mismatch: on agent rows of thousands of tokens, bf16-level
    # numerics alone take it out of any band (sequence_mask dropped 16-52% of 8k-token rows in the audit's
    # measurement); a truncated per-token ratio keeps every token at a weight near 1
    # (docs/benchmarks/trainer.md, bench/bench_is_agent_rows.py).
    vllm_importance_sampling_mode: str = field(default="token_truncate", metadata={
        "help": "token_truncate (default: per-token ratio clamped to [clip_min, clip_max]) | token_mask | "
        "sequence_truncate | sequence_mask (TRL's default; a product over the row: drops long agent rows on "
        "numerics alone). Every token a mode gives weight 0 is counted in polar/excluded_share."})

    # A bf16 server cuts on bf16 logits (min_p's threshold on the bf16 grid, top_k's ties); an fp32 trainer
    # cutting on its own logits disagrees one way on average, a bias of up to a few 1e-3 per token in the
    # mean log ratio under min_p / a large top_k (docs/benchmarks/trainer.md, bench/bench_is_agent_rows.py).
    server_logits_dtype: str | None = field(default=None, metadata={
        "help": "The precision of the server's logits (bfloat16 | float16), when it is below the trainer's: pi_old's "
        "top_k/top_p/min_p cuts are then made on the trainer's logits rounded to it (the probabilities stay the "
        "trainer's). Set bfloat16 for a bf16 server (vLLM's default for bf16 models) with an fp32 trainer. "
        "None: cut on the trainer's logits as they are (right when both share a precision)."})
    shards: str | None = field(default=None, metadata={
        "help": "Shard directory or filesystem URI (file://, s3://, memory://, ...) that polar-recon writes."})
    shard_poll_interval: float = field(default=1.0, metadata={"help": "Seconds between directory listings."})
    shard_wait_timeout: float | None = field(default=None, metadata={
        "help": "Fail if no group arrives for this many seconds (None: wait forever)."})
    max_policy_lag: int | None = field(default=4, metadata={
        "help": "Drop groups whose weight_version is more than this many syncs behind the current one, by the "
        "sync history (and groups whose version is unknown or spans a sync; a null version counts as the "
        "oldest). Applies once versions have an order (a sync history, or integer versions). None: keep all."})
    group_size_policy: str = field(default="pad", metadata={
        "help": "Groups whose row count differs from num_generations: 'pad' (whole episodes, zero-weight "
        "padding rows) or 'skip'."})
    drop_incomplete_groups: bool = field(default=True, metadata={
        "help": "Drop groups recon wrote after a timeout (group_complete=false): their baseline would cover "
        "only the episodes that finished first (a length-correlated bias). False: train them."})
    max_excluded_share: float | None = field(default=0.5, metadata={
        "help": "Stop (every rank, naming each cause and its fix) when more than this share of the trainable "
        "tokens read in the last excluded_share_window tokens was excluded (greedy, temperature mismatch, "
        "raw/unknown logprobs, unsupported sampling, realigned rows, non-finite logprobs). None: never stop."})
    excluded_share_window: int = field(default=20000, metadata={
        "help": "Trainable tokens (whole groups, per rank) over which max_excluded_share is measured; the check "
        "starts once this many were read."})
    max_realign_share: float | None = field(default=0.5, metadata={
        "help": "Exclude (counted: realign_share) episodes with a row whose re-rendered context tokens "
        "(realign_tokens) exceed this share of the row. None: no gate."})
    realign_is: str = field(default="correct", metadata={
        "help": "Rows with re-rendered context below the gate: 'correct' (the ratio of the sampled tokens, pi_old "
        "on the row's context; the context differs from the served one only by a known re-render class, counted "
        "in polar/is_realign_exempt_token_share) or 'exempt' (ratio 1: no correction for those rows)."})
    shard_max_length: int | None = field(default=None, metadata={
        "help": "Exclude (counted, logged: too_long) episodes with a row longer than this many tokens. Default: "
        "the model's max_position_embeddings. TRL truncates nothing on the rollout_func path."})
    # Weight sync (trainer/weight_sync.py). Off unless sync_server is set.
    sync_server: str | None = field(default=None, metadata={
        "help": "Base URL of the inference server, e.g. http://127.0.0.1:8000."})
    sync_steps: int = field(default=1, metadata={"help": "Push the weights every this many optimizer steps."})
    sync_mode: str = field(default="polar", metadata={
        "help": "'proxy': full weights + POST /polar/@weights to the capture proxy (sync_server = the proxy's URL; "
        "it holds calls and has vLLM, SGLang or polar-serve load them); 'polar': full weights + POST "
        "/polar/reload to polar-serve; 'vllm_lora': adapter + POST /v1/load_lora_adapter; 'fleet': full weights "
        "through a running polar-rollout fleet's coordinator (sync_server = the Ray address, auto | HOST:PORT): "
        "every proxy of every node holds while the server loads them once."})
    sync_dir: str | None = field(default=None, metadata={
        "help": "Where synced weights are written (default OUTPUT_DIR/polar-weights)."})
    sync_secret_file: str | None = field(default=None, metadata={
        "help": "sync_mode=proxy: file holding the proxy's control secret (mode 0600; default: the file in "
                "$POLAR_CONTROL_SECRET_FILE). A proxy with a secret refuses syncs without it."})
    sync_keep: int = field(default=2, metadata={"help": "How many synced weight directories to keep."})
    lora_name: str = field(default="polar", metadata={"help": "Adapter name for sync_mode=vllm_lora."})
    served_default_temperature: float | None = field(default=None, metadata={
        "help": "The temperature the server applies to requests that set none (its model's "
        "generation_config.json). Default: the policy model's generation_config. Every shard row's "
        "sampling temperature must equal --temperature (trainer/row_temperature.py)."})

    def __post_init__(self):
        fall_back_to_cpu(self)  # before GRPOConfig's bf16 default meets TrainingArguments' GPU check
        super().__post_init__()
        if self.use_vllm:
            raise ValueError("PolarGRPOConfig trains on recorded shards: use_vllm must be False "
                             "(importance sampling uses the recorded logprobs instead)")
        if self.vllm_importance_sampling_mode not in IS_MODES:
            raise ValueError(f"vllm_importance_sampling_mode {self.vllm_importance_sampling_mode!r} not in {IS_MODES}")
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction \
                and not self.vllm_importance_sampling_mode.startswith("token"):
            raise ValueError("the vespo loss needs a token_* importance sampling mode (as in TRL)")
        if self.off_policy_mask_threshold is not None and not self.vllm_importance_sampling_correction:
            raise ValueError(
                "off_policy_mask_threshold (TRL's off-policy sequence mask) compares the recorded behaviour logprobs "
                "with the policy's full-softmax logprobs; polar's behaviour logprobs are those of the distribution "
                "the server sampled from, which under top_k/top_p/min_p is truncated and renormalised, so the KL "
                "it reads is the kept mass, not the staleness (0.02-0.09 per token on-policy), and it would drop "
                "negative-advantage sequences for no reason. Without the correction the rows' sampling is not "
                "resolved, so polar cannot check that they are untruncated: turn "
                "vllm_importance_sampling_correction on (OPSM is then allowed on untruncated rows only) or unset "
                "off_policy_mask_threshold")
        if self.server_logits_dtype is not None and self.server_logits_dtype not in SERVER_LOGITS_DTYPES:
            raise ValueError(f"server_logits_dtype {self.server_logits_dtype!r} not in {SERVER_LOGITS_DTYPES} (or None)")
        if self.realign_is not in REALIGN_IS:
            raise ValueError(f"realign_is {self.realign_is!r} not in {REALIGN_IS}")
        for name in ("max_excluded_share", "max_realign_share"):
            v = getattr(self, name)
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(f"{name} must be in [0, 1] or None, got {v}")
        if self.excluded_share_window < 1:
            raise ValueError(f"excluded_share_window must be >= 1 token, got {self.excluded_share_window}")
        if self.group_size_policy not in GROUP_SIZE_POLICIES:
            raise ValueError(f"group_size_policy {self.group_size_policy!r} not in {GROUP_SIZE_POLICIES}")
        if self.max_steps is None or self.max_steps <= 0:
            raise ValueError("set max_steps: a shard stream has no length, so epochs mean nothing")
        if self.eval_strategy not in ("no", None) and str(self.eval_strategy) != "IntervalStrategy.NO":
            raise ValueError("evaluation is not supported: every rollout comes from the training shard stream")
        if self.sync_mode not in SYNC_MODES:  # (trainer/weight_sync.py)
            raise ValueError(f"sync_mode {self.sync_mode!r} not in {SYNC_MODES}")
        self._check_save_alignment()

    def _check_save_alignment(self) -> None:
        # The cursor counts groups handed to the trainer. It equals "groups trained" only at checkpoints
        # that fall on a generation boundary; refuse a save_steps that could land mid-generation.
        generate_every = self.steps_per_generation * self.num_iterations  # micro-steps per rollout
        save = self.save_steps
        if str(self.save_strategy).lower().endswith("steps") and save and save >= 1 and float(save).is_integer():
            if (int(save) * self.gradient_accumulation_steps) % generate_every:
                raise ValueError(
                    f"save_steps={int(save)} would checkpoint in the middle of a rollout batch (a rollout spans "
                    f"{generate_every} micro-steps = steps_per_generation {self.steps_per_generation} x "
                    f"num_iterations {self.num_iterations}, gradient_accumulation_steps "
                    f"{self.gradient_accumulation_steps}); the shard cursor would then be inexact. Use a multiple.")
