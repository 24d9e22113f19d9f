"""TRL GRPO over Polar shards: a GRPOConfig with the shard fields and a GRPOTrainer subclass.

Extension points used (TRL 1.16), and nothing else:
- ``rollout_func``: pulls G-row groups from the ShardSource instead of generating (trainer/shard_rollout.py
  documents the row mapping and the group-size policy). Returns ``env_mask`` (the shard's loss mask)
  and the recorded ``logprobs``, which TRL pads into ``sampling_per_token_logps``.
- reward function ``shard_reward``: returns the shard's ``reward`` column, forwarded by TRL from the
  rollout's extra keys.
- one subclass hook, ``_generate_and_score_completions``: after TRL has built the batch, replace its
  advantages by per-episode ones (below), then apply importance sampling against the recorded
  behaviour logprobs. ``_calculate_rewards`` is extended only to keep TRL's (all-rank) reward matrix
  for that (its return value is TRL's, unchanged).
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

Advantages per episode (trainer/advantages.py has the formulas). TRL normalises over each block of
``num_generations`` rows (``rewards.view(-1, G)``), so an episode of k segments would count k times in
its group's mean and std, and a group laid out over several blocks (rollout.py) would be split. The
hook recomputes them from the rows' ``group_id``/``episode_id`` (gathered from every rank, in TRL's
gather order, next to TRL's gathered ``rewards_per_func``): one reward per episode (the weighted sum of
the reward functions, ``reward_weights``, averaged over the episode's rows; ``shard_reward`` gives every
row the episode's reward), the group's baseline = the mean over its EPISODES, and the scale by
``scale_rewards`` exactly as TRL defines the modes: ``"group"`` divides by the std (Bessel, TRL's
``nanstd``) of the group's episode rewards + 1e-4, ``"batch"`` by the std of every episode reward in the
generation batch (all ranks) + 1e-4, ``"none"`` does not divide; ``multi_objective_aggregation=
"normalize_then_sum"`` normalises each function over the group's episodes, sums, then normalises over
the batch's episodes, as TRL does over rows. Every row of an episode gets the episode's advantage;
padding rows and unscorable episodes 0; a group with one scorable episode 0 (as TRL: std NaN). The
rank's slice is ``[process_index * len(inputs), ...)``, TRL's own; TRL's logged advantages are
replaced by these.

Loss normalisation with several rows of one episode. Recon trains each sampled token in exactly one
row, so the rows of an episode hold disjoint trainable tokens. Token-level losses (``dapo``, TRL's
default, ``bnpo``, ``cispo``, ``vespo``: sum over trainable tokens / their count; ``dr_grpo``: / (rows x
max_completion_length); ``luspo``: per-row token sums averaged over rows) weigh every token the same
wherever it sits, so an episode weighs the same split or not. The per-row-mean losses (``grpo``,
``sapo``: each row's token mean, averaged over rows) would count an episode of k rows k times: for them
the hook multiplies each row's advantage by (row's trainable tokens / episode's), which makes the k rows
sum to what one row holding all the episode's tokens gives (the loss is positively homogeneous in the
advantage; the KL term, if ``beta`` > 0, is not reweighted). Padding rows (env_mask 0) add no token;
for ``grpo``/``sapo``/``luspo``/``dr_grpo`` they still count in the row count that divides the loss
(a constant scale per batch).

Truncation. ``mask_truncated_completions`` is applied by the rollout from the shard's ``termination``
(rollout.py): rows of episodes that ended by ``length``/``timeout`` get env_mask 0 whatever their last
token, rows without a recorded termination keep TRL's last-token rule, and TRL's own rule is turned
off. Rows longer than ``shard_max_length`` (default: the model's ``max_position_embeddings``) are
excluded with their episode and counted (``too_long``): TRL 1.16 truncates nothing on the
``rollout_func`` path (no ``max_prompt_length``; ``max_completion_length`` bounds only TRL's own
generation), so excluding is the only way such a row does not run past the model's positions; a
refusal in the config cannot work since lengths are known only when the shards are read.

Ranks. Each rank's ShardSource takes only its partition of the groups (shard_source.py: Ranks) and
saves its own cursor into each checkpoint. The ranks fill their batches in lockstep (ShardRollout:
every poll interval they exchange "done" and "ran past shard_wait_timeout"); when one rank's partition
runs dry past the timeout, EVERY rank raises NoShardsError in the same call, so none is left blocked in
a collective; with no timeout all ranks wait together for the data.

pi_old for the ratio: the hook ``_old_policy_logps(output, transforms)`` (override it to change how
the old policy's log-probs are formed). The behaviour logprobs are the server's, of the distribution
it sampled from: with truncated sampling (Qwen3's generation_config: T=0.6, top_k=20, top_p=0.95,
applied to every request that sets none) that is the renormalised kept set, not the full softmax.
So pi_old of each sampled token is taken under the SAME transform, per row, from the shard's
columns (trainer/behaviour_logprobs.py: processed = temperature, min_p, top_k, top_p in vLLM 0.32's order,
renormalised; scaled (SGLang) = temperature only); a full-softmax pi_old would make every token's
ratio its kept mass and ``sequence_mask`` would drop every row. TRL's own loss logps
(``old_per_token_logps``, the PPO ratio) stay full-softmax at ``temperature``: both sides of that
ratio are the same policy family, so it needs no truncation. When no row truncates, pi_old is TRL's
``old_per_token_logps`` if computed (misaligned steps), else one no-grad forward (what TRL does for
its vLLM path). With the correction on, rows with raw or unknown logprob modes stop training with the
fix (trainer/behaviour_logprobs.py FIX; raw rows of identity sampling, where raw is processed, excepted), and
episodes the trainer cannot reproduce (``sampling_unsupported``, unknown truncation) are excluded,
counted (``polar/rows_excluded_sampling_total``) and logged.

Temperature: the trainer's logps divide the logits by ``temperature``; it must be the sampling
temperature the server used, or the ratio measures the temperature, not the staleness. Shards
record each row's requested temperature and every group is checked against ``temperature``
(trainer/row_temperature.py; a request without one got the served model's
generation_config.json default).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOTrainer

from trainer.advantages import episode_advantages
from trainer.behaviour_logprobs import Transform, token_logprobs
from trainer.grpo_config import PolarGRPOConfig
from trainer.is_correction import is_ratio
from trainer.row_temperature import generation_default
from trainer.shard_rollout import ShardRollout, shard_reward
from trainer.shard_source import ShardCursor, ShardSource

log = logging.getLogger(__name__)

PLACEHOLDER_PROMPT = "<polar: the rollout comes from a shard>"
PER_ROW_MEAN_LOSSES = ("grpo", "sapo")  # TRL losses that average each row's token mean over rows


def placeholder_dataset(n: int) -> Dataset:
    return Dataset.from_dict({"prompt": [PLACEHOLDER_PROMPT] * n})


class ShardCursorCallback(TrainerCallback):
    """Writes the shard cursor into each checkpoint directory (after the trainer wrote it)."""

    def __init__(self, source: ShardSource):
        self.source = source

    def on_save(self, args, state, control, **kwargs):
        # Every rank saves its own cursor (shard_source.py: Ranks); rank 0 made the directory.
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if self.source.rank and not ckpt.is_dir():
            ckpt.mkdir(parents=True, exist_ok=True)  # a node that does not share rank 0's disk
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
                                 max_policy_lag=args.max_policy_lag, drop_incomplete=args.drop_incomplete_groups,
                                 rank=args.process_index, world_size=args.world_size)
        elif (source.rank, source.world_size) != (args.process_index, args.world_size):
            raise ValueError(f"the ShardSource partitions for rank {source.rank} of {source.world_size}, but this "
                             f"process is rank {args.process_index} of {args.world_size}: pass rank= and world_size=")
        self.shard_source = source
        served_t = args.served_default_temperature
        if served_t is None:
            served_t = generation_default(model)
        max_length = args.shard_max_length
        if max_length is None:
            max_length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.shard_rollout = ShardRollout(source, args.num_generations, args.group_size_policy,
                                          args.shard_wait_timeout, args.temperature, served_t,
                                          is_correction=args.vllm_importance_sampling_correction,
                                          max_length=max_length, mask_truncated=args.mask_truncated_completions)
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
        # The rollout masks truncated episodes by their recorded termination (rollout.py); TRL's own rule
        # (last token not EOS) would mask segments that end in a tool result and miss length stops.
        self.mask_truncated_completions = False
        self._polar_rewards_per_func: torch.Tensor | None = None

    def train(self, resume_from_checkpoint=None, **kwargs):
        ckpt = resume_from_checkpoint
        if ckpt is True:
            ckpt = get_last_checkpoint(self.args.output_dir)
            if ckpt is None:
                raise ValueError(f"resume requested but no checkpoint in {self.args.output_dir}")
        if ckpt:
            src = self.shard_source
            self.shard_source.restore(ShardCursor.load(ckpt, src.rank, src.world_size))
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    # -- the one hook ---------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        t0 = time.perf_counter()
        load0, wait0 = self.shard_source.stats.load_seconds, self.shard_source.stats.wait_seconds
        output = super()._generate_and_score_completions(inputs)
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        self._episode_advantages(inputs, output)
        if self.args.vllm_importance_sampling_correction:
            self._apply_behaviour_is(output, metrics)
        self._log_shard_metrics(metrics, load0, wait0, time.perf_counter() - t0)
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # Kept (all ranks' rows, (N, F)) for the per-episode advantages; TRL's value is returned unchanged.
        self._polar_rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._polar_rewards_per_func

    def _episode_advantages(self, inputs: list[dict], output: dict) -> None:
        """Replace TRL's per-row group advantages by per-episode ones (trainer/advantages.py), over the
        rows of every rank (TRL gathers the rewards; the ids are gathered here in the same order)."""
        from accelerate.utils import gather_object

        rpf = self._polar_rewards_per_func
        if rpf is None:
            raise RuntimeError("no rewards recorded for this batch")
        groups = gather_object([x["group_id"] for x in inputs])
        episodes = gather_object([None if x["polar_pad"] else x["episode_id"] for x in inputs])
        if len(groups) != rpf.size(0):
            raise RuntimeError(f"{len(groups)} gathered rows, {rpf.size(0)} rewards: rank batches disagree")
        adv = episode_advantages(groups, episodes, rpf.tolist(), self.reward_weights.tolist(),
                                 self.scale_rewards, self.multi_objective_aggregation)
        start = self.accelerator.process_index * len(inputs)
        local = torch.tensor(adv[start:start + len(inputs)], dtype=output["advantages"].dtype,
                             device=output["advantages"].device)
        if self.loss_type in PER_ROW_MEAN_LOSSES:
            local = local * self._episode_row_weights(inputs, output).to(local)
        output["advantages"] = local
        # TRL logged its per-row advantages of the whole batch last: log these instead.
        logged = self._logs["advantages"]
        for _ in range(min(len(adv), len(logged))):
            logged.pop()
        logged.extend(adv)
        self._polar_rewards_per_func = None

    @staticmethod
    def _episode_row_weights(inputs: list[dict], output: dict) -> torch.Tensor:
        """Per row: its trainable tokens / its episode's (this rank holds every row of its groups). With a
        per-row-mean loss (grpo, sapo) this makes an episode of k rows weigh what one row holding all its
        tokens would (module doc: Loss normalisation). Padding rows and rows with no trainable token: 1
        (their advantage is 0 or they add nothing)."""
        mask = output["completion_mask"] * output["tool_mask"] if "tool_mask" in output else output["completion_mask"]
        n = mask.sum(1).float().cpu()
        keys = [None if x["polar_pad"] else (x["group_id"], x["episode_id"]) for x in inputs]
        total: dict = {}
        for k, c in zip(keys, n.tolist()):
            if k is not None:
                total[k] = total.get(k, 0.0) + c
        return torch.tensor([c / total[k] if k is not None and total[k] > 0 else 1.0 for k, c in zip(keys, n.tolist())])

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
        metrics["polar/rows_excluded_sampling_total"].append(
            sum(v for k, v in st.rows_excluded.items() if k != "too_long"))
        metrics["polar/groups_dropped_total"].append(sum(src.dropped.values()))
        metrics["polar/groups_deferred_total"].append(st.groups_deferred)
        metrics["polar/groups_multi_block_total"].append(st.groups_multi_block)
        metrics["polar/rows_skipped_total"].append(st.rows_skipped)
        metrics["polar/rows_excluded_too_long_total"].append(st.rows_excluded.get("too_long", 0))
        metrics["polar/rows_masked_truncated_total"].append(st.rows_masked_truncated)
        if st.landing_latency:
            metrics["polar/landing_to_batch_s"].append(sum(st.landing_latency) / len(st.landing_latency))
        if st.policy_lag:
            metrics["polar/policy_lag"].append(sum(st.policy_lag) / len(st.policy_lag))
        if self.shard_source.current_version is not None:
            metrics["polar/weight_version"].append(self.shard_source.current_version)
        st.landing_latency.clear()
        st.policy_lag.clear()
