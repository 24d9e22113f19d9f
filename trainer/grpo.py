"""TRL GRPO over Polar shards: a GRPOConfig with the shard fields and a GRPOTrainer subclass.

Extension points used (TRL 1.16), and nothing else:
- ``rollout_func``: pulls G-row groups from the ShardSource instead of generating (trainer/rollout.py
  documents the row mapping and the group-size policy). Returns ``env_mask`` (the shard's loss mask)
  and the recorded ``logprobs``, which TRL pads into ``sampling_per_token_logps``.
- reward function ``shard_reward``: returns the shard's ``reward`` column, forwarded by TRL from the
  rollout's extra keys.
- one subclass hook, ``_generate_and_score_completions``: after TRL has built the batch and the
  group-normalised advantages, apply importance sampling against the recorded behaviour logprobs.
  TRL runs its own correction only with ``use_vllm=True``; here the same modes, names and defaults
  (``vllm_importance_sampling_correction/mode/clip_min/clip_max``, which this config reuses) are
  applied by scaling the advantages per token (B, T) or per sequence (B, 1), a shape TRL's loss
  explicitly accepts from subclasses. For every loss but vespo the per-token loss is positively
  homogeneous in the advantage (-min(r*A*w, clip(r)*A*w) = -w*min(r*A, clip(r)*A) for w >= 0; cispo
  and sapo are linear in A), so this equals TRL's ``per_token_loss * importance_sampling_ratio``
  exactly, with the KL term left uncorrected as in TRL. For vespo the ratio goes to
  ``inputs["importance_sampling_ratio"]``, which TRL's vespo loss reads.
- ``train(resume_from_checkpoint=...)`` restores the shard cursor; a TrainerCallback writes it into
  every checkpoint directory.

pi_old for the ratio: the hook ``_old_policy_logps(output, transforms)`` (override it to change how
the old policy's log-probs are formed). The behaviour logprobs are the server's, of the distribution
it sampled from: with truncated sampling (Qwen3's generation_config: T=0.6, top_k=20, top_p=0.95,
applied to every request that sets none) that is the renormalised kept set, not the full softmax.
So pi_old of each sampled token is taken under the SAME transform, per row, from the shard's
columns (trainer/sampling.py: processed = temperature, min_p, top_k, top_p in vLLM 0.32's order,
renormalised; scaled (SGLang) = temperature only); a full-softmax pi_old would make every token's
ratio its kept mass and ``sequence_mask`` would drop every row. TRL's own loss logps
(``old_per_token_logps``, the PPO ratio) stay full-softmax at ``temperature``: both sides of that
ratio are the same policy family, so it needs no truncation. When no row truncates, pi_old is TRL's
``old_per_token_logps`` if computed (misaligned steps), else one no-grad forward (what TRL does for
its vLLM path). With the correction on, rows with raw or unknown logprob modes stop training with the
fix (trainer/sampling.py FIX; raw rows of identity sampling, where raw is processed, excepted), and
episodes the trainer cannot reproduce (``sampling_unsupported``, unknown truncation) are excluded,
counted (``polar/rows_excluded_sampling_total``) and logged.

Temperature: the trainer's logps divide the logits by ``temperature``; it must be the sampling
temperature the server used, or the ratio measures the temperature, not the staleness. Shards
record each row's requested temperature and every group is checked against ``temperature``
(trainer/sampling_temperature.py; a request without one got the served model's
generation_config.json default).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOConfig, GRPOTrainer

from trainer.is_correction import MODES, is_ratio
from trainer.rollout import POLICIES, RolloutStats, fit_group, resolve_sampling, rows_to_columns
from trainer.sampling import Transform, token_logprobs
from trainer.sampling_temperature import check_rows, generation_default
from trainer.shard_source import ShardCursor, ShardSource

log = logging.getLogger(__name__)

PLACEHOLDER_PROMPT = "<polar: the rollout comes from a shard>"


@dataclass
class PolarGRPOConfig(GRPOConfig):
    """GRPOConfig plus the shard stream. Importance sampling reuses TRL's own fields
    ``vllm_importance_sampling_correction`` (default True), ``vllm_importance_sampling_mode``
    (token_truncate | token_mask | sequence_truncate | sequence_mask, default sequence_mask),
    ``vllm_importance_sampling_clip_max`` (3.0) and ``vllm_importance_sampling_clip_min`` (None),
    applied to the recorded behaviour logprobs with ``use_vllm=False``."""

    shards: str | None = field(default=None, metadata={
        "help": "Shard directory or filesystem URI (file://, s3://, memory://, ...) that polar-recon writes."})
    shard_poll_interval: float = field(default=1.0, metadata={"help": "Seconds between directory listings."})
    shard_wait_timeout: float | None = field(default=None, metadata={
        "help": "Fail if no group arrives for this many seconds (None: wait forever)."})
    max_policy_lag: int | None = field(default=None, metadata={
        "help": "Drop groups whose weight_version is more than this many syncs behind the current one, by the "
        "sync history (and groups whose version is unknown or spans a sync). None: keep all."})
    group_size_policy: str = field(default="pad", metadata={
        "help": "Groups whose row count differs from num_generations: 'pad' (whole episodes, zero-weight "
        "padding rows) or 'skip'."})
    drop_incomplete_groups: bool = field(default=False, metadata={
        "help": "Drop groups recon wrote after a timeout (group_complete=false)."})
    # Weight sync (trainer/weight_sync.py). Off unless sync_server is set.
    sync_server: str | None = field(default=None, metadata={
        "help": "Base URL of the inference server, e.g. http://127.0.0.1:8000."})
    sync_steps: int = field(default=1, metadata={"help": "Push the weights every this many optimizer steps."})
    sync_mode: str = field(default="polar", metadata={
        "help": "'proxy': full weights + POST /polar/@weights to the capture proxy (sync_server = the proxy's URL; "
        "it holds calls and has vLLM, SGLang or polar-serve load them); 'polar': full weights + POST "
        "/polar/reload to polar-serve; 'vllm_lora': adapter + POST /v1/load_lora_adapter."})
    sync_dir: str | None = field(default=None, metadata={
        "help": "Where synced weights are written (default OUTPUT_DIR/polar-weights)."})
    sync_keep: int = field(default=2, metadata={"help": "How many synced weight directories to keep."})
    lora_name: str = field(default="polar", metadata={"help": "Adapter name for sync_mode=vllm_lora."})
    served_default_temperature: float | None = field(default=None, metadata={
        "help": "The temperature the server applies to requests that set none (its model's "
        "generation_config.json). Default: the policy model's generation_config. Every shard row's "
        "sampling temperature must equal --temperature (trainer/sampling_temperature.py)."})

    def __post_init__(self):
        super().__post_init__()
        if self.use_vllm:
            raise ValueError("PolarGRPOConfig trains on recorded shards: use_vllm must be False "
                             "(importance sampling uses the recorded logprobs instead)")
        if self.vllm_importance_sampling_mode not in MODES:
            raise ValueError(f"vllm_importance_sampling_mode {self.vllm_importance_sampling_mode!r} not in {MODES}")
        if self.loss_type == "vespo" and self.vllm_importance_sampling_correction \
                and not self.vllm_importance_sampling_mode.startswith("token"):
            raise ValueError("the vespo loss needs a token_* importance sampling mode (as in TRL)")
        if self.group_size_policy not in POLICIES:
            raise ValueError(f"group_size_policy {self.group_size_policy!r} not in {POLICIES}")
        if self.max_steps is None or self.max_steps <= 0:
            raise ValueError("set max_steps: a shard stream has no length, so epochs mean nothing")
        if self.eval_strategy not in ("no", None) and str(self.eval_strategy) != "IntervalStrategy.NO":
            raise ValueError("evaluation is not supported: every rollout comes from the training shard stream")
        if self.sync_mode not in ("polar", "proxy", "vllm_lora"):  # (trainer/weight_sync.py)
            raise ValueError(f"sync_mode {self.sync_mode!r} not in ('polar', 'proxy', 'vllm_lora')")
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


def shard_reward(prompts, completions, reward, **kwargs) -> list[float | None]:
    """The reward recorded in the shard (the episode's reward; None on padding rows)."""
    return list(reward)


class ShardRollout:
    """The ``rollout_func``: pulls len(prompts)/G groups from the source, G rows each."""

    def __init__(self, source: ShardSource, num_generations: int, policy: str = "pad",
                 wait_timeout: float | None = None, temperature: float | None = None,
                 served_default_temperature: float = 1.0, is_correction: bool = False):
        self.source = source
        self.g = num_generations
        self.policy = policy
        self.wait_timeout = wait_timeout
        self.temperature = temperature  # the trainer's; None: not checked
        self.served_default_temperature = served_default_temperature
        self.is_correction = is_correction  # resolve each row's sampling transform (refuse / exclude)
        self.stats = RolloutStats()
        self.batch_transforms: list[Transform | None] = []  # of the last call's rows, in order

    def __call__(self, prompts: list, trainer=None) -> dict[str, list]:
        if len(prompts) % self.g:
            raise ValueError(f"{len(prompts)} prompts is not a multiple of num_generations {self.g}")
        rows: list[dict] = []
        while len(rows) < len(prompts):
            group = self.source.next_group(self.wait_timeout)
            if self.is_correction:
                group, excluded = resolve_sampling(group, self.served_default_temperature)
                for ep, n, why in excluded:
                    self.stats.rows_excluded[why] += n
                    log.warning("group %s of %s: excluding episode %s (%d rows) from training: %s",
                                group.group_id, group.shard, ep, n, why)
            if self.temperature is not None:
                check_rows(group.rows, self.temperature, self.served_default_temperature,
                           f"group {group.group_id} of {group.shard}")
            fitted, note = fit_group(group, self.g, self.policy)
            if fitted is None:
                self.stats.skipped["size_mismatch" if self.policy == "skip" else "too_few_episodes"] += 1
                log.warning("skipping group %s of %s: %s", group.group_id, group.shard, note)
                continue
            if note:
                log.info("group %s of %s: %s", group.group_id, group.shard, note)
            n_real = sum(not r["polar_pad"] for r in fitted)
            self.stats.rows_padded += self.g - n_real
            self.stats.rows_trimmed += len(group.rows) - n_real
            self.stats.groups += 1
            self.stats.landing_latency.append(time.time() - group.landed_at)
            lag = self.source.lag_of(group)  # (shard_source.py: syncs behind, by the sync history)
            if lag is not None:
                self.stats.policy_lag.append(lag)
            rows += fitted
        self.batch_transforms = [r["transform"] for r in rows]
        return rows_to_columns(rows)


def placeholder_dataset(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * n})


class ShardCursorCallback(TrainerCallback):
    """Writes the shard cursor into each checkpoint directory (after the trainer wrote it)."""

    def __init__(self, source: ShardSource):
        self.source = source

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if not ckpt.is_dir():
                raise FileNotFoundError(f"checkpoint directory {ckpt} missing when saving the shard cursor")
            self.source.cursor.save(ckpt)


class PolarGRPOTrainer(GRPOTrainer):
    def __init__(self, model, args: PolarGRPOConfig, *, source: ShardSource | None = None,
                 reward_funcs=None, processing_class=None, callbacks=None, **kwargs):
        if not isinstance(args, PolarGRPOConfig):
            raise TypeError("PolarGRPOTrainer needs a PolarGRPOConfig")
        if source is None:
            if not args.shards:
                raise ValueError("give a ShardSource or set PolarGRPOConfig.shards")
            source = ShardSource(args.shards, poll_interval=args.shard_poll_interval,
                                 max_policy_lag=args.max_policy_lag, drop_incomplete=args.drop_incomplete_groups)
        self.shard_source = source
        served_t = args.served_default_temperature
        if served_t is None:
            served_t = generation_default(model)
        self.shard_rollout = ShardRollout(source, args.num_generations, args.group_size_policy,
                                          args.shard_wait_timeout, args.temperature, served_t,
                                          is_correction=args.vllm_importance_sampling_correction)
        self.polar_is_stats: dict[str, float] = {}
        callbacks = [ShardCursorCallback(source), *(callbacks or [])]
        if args.sync_server:
            from trainer.weight_sync import WeightSyncCallback
            callbacks.append(WeightSyncCallback.from_config(args, source))
        super().__init__(
            model=model,
            reward_funcs=[shard_reward, *(reward_funcs or [])],
            args=args,
            train_dataset=placeholder_dataset(args.generation_batch_size // args.num_generations),
            processing_class=processing_class,
            callbacks=callbacks,
            rollout_func=self.shard_rollout,
            **kwargs,
        )

    def train(self, resume_from_checkpoint=None, **kwargs):
        ckpt = resume_from_checkpoint
        if ckpt is True:
            ckpt = get_last_checkpoint(self.args.output_dir)
            if ckpt is None:
                raise ValueError(f"resume requested but no checkpoint in {self.args.output_dir}")
        if ckpt:
            self.shard_source.restore(ShardCursor.load(ckpt))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    # -- the one hook ---------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        load0, wait0 = self.shard_source.stats.load_seconds, self.shard_source.stats.wait_seconds
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        if self.args.vllm_importance_sampling_correction:
            self._apply_behaviour_is(output, metrics)
        self._log_shard_metrics(metrics, load0, wait0, time.perf_counter() - t0)
        return output

    def _apply_behaviour_is(self, output: dict, metrics) -> None:
        behaviour = output.get("sampling_per_token_logps")
        if behaviour is None:
            raise RuntimeError("rollout returned no behaviour logprobs; cannot apply importance sampling")
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        old = self._old_policy_logps(output, self.shard_rollout.batch_transforms)
        outside = (torch.isinf(old) & mask.bool()).sum().item()
        metrics["polar/is_tokens_outside_kept_set"].append(outside)
        if outside:
            log.warning("%d sampled tokens fall outside the kept set of the transform their rows record (ratio 0 "
                        "for them): the recorded sampling parameters are not the ones the server applied", outside)
        args = self.args
        ratio, stats = is_ratio(old, behaviour, mask, args.vllm_importance_sampling_mode,
                                args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max)
        if self.loss_type == "vespo":
            output["importance_sampling_ratio"] = ratio
        else:
            adv = output["advantages"]
            output["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * ratio
        self.polar_is_stats = stats
        # TRL's metric names for its vLLM correction, plus raw_mean and clipped_frac.
        for k, v in stats.items():
            if k.startswith("logp_diff_"):
                metrics[f"sampling/sampling_logp_difference/{k.removeprefix('logp_diff_')}"].append(v)
            else:
                metrics[f"sampling/importance_sampling_ratio/{k}"].append(v)

    @torch.no_grad()
    def _old_policy_logps(self, output: dict, transforms: list[Transform]) -> torch.Tensor:
        """The hook: log pi_old of each completion token (B, T) under the transform the server's logprobs
        for that row reflect (``transforms``, one per row, in rollout order). Positions outside the
        completion mask are 0 (the ratio ignores them)."""
        completion = output["completion_ids"]
        b, t = completion.shape
        if len(transforms) != b or any(x is None for x in transforms):
            raise RuntimeError(f"{len(transforms)} row transforms for {b} rows: the rollout and the batch disagree")
        if not any(x.truncates for x in transforms) and all(
                abs(x.temperature - self.temperature) < 1e-6 for x in transforms):
            old = output.get("old_per_token_logps")  # TRL's full softmax at `temperature` is the transform
            return old if old is not None else self._policy_logps(output)
        ids = torch.cat([output["prompt_ids"], completion], dim=1)
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        mask = output["completion_mask"] * output["tool_mask"] if "tool_mask" in output else output["completion_mask"]
        out = torch.zeros(b, t, dtype=torch.float32, device=completion.device)
        bs = self.args.per_device_train_batch_size
        for s in range(0, b, bs):
            # As TRL's _get_per_token_logps_and_entropies: the logits that predict each completion token.
            logits = self.model(input_ids=ids[s:s + bs], attention_mask=attn[s:s + bs],
                                logits_to_keep=t + 1).logits[:, :-1][:, -t:]
            for j in range(logits.size(0)):
                pos = mask[s + j].nonzero().squeeze(-1)
                if pos.numel():
                    out[s + j, pos] = token_logprobs(logits[j, pos], completion[s + j, pos], transforms[s + j])
            del logits
        return out

    @torch.no_grad()
    def _policy_logps(self, output: dict) -> torch.Tensor:
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attn = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        logps, _, _ = self._get_per_token_logps_and_entropies(
            self.model, ids, attn, output["completion_ids"].size(1),
            batch_size=self.args.per_device_train_batch_size)
        return logps

    def _log_shard_metrics(self, metrics, load0: float, wait0: float, seconds: float) -> None:
        src, st = self.shard_source.stats, self.shard_rollout.stats
        load, wait = src.load_seconds - load0, src.wait_seconds - wait0
        metrics["polar/shard_load_s"].append(load)
        metrics["polar/shard_wait_s"].append(wait)
        metrics["polar/rollout_s"].append(seconds)
        metrics["polar/groups_total"].append(st.groups)
        metrics["polar/rows_padded_total"].append(st.rows_padded)
        metrics["polar/groups_skipped_total"].append(sum(st.skipped.values()))
        metrics["polar/rows_excluded_sampling_total"].append(sum(st.rows_excluded.values()))
        metrics["polar/groups_dropped_total"].append(sum(src.dropped.values()))
        if st.landing_latency:
            metrics["polar/landing_to_batch_s"].append(sum(st.landing_latency) / len(st.landing_latency))
        if st.policy_lag:
            metrics["polar/policy_lag"].append(sum(st.policy_lag) / len(st.policy_lag))
        if self.shard_source.current_version is not None:
            metrics["polar/weight_version"].append(self.shard_source.current_version)
        st.landing_latency.clear()
        st.policy_lag.clear()
