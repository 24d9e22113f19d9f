"""TRL GRPO over Polar shards: PolarGRPOTrainer, a GRPOTrainer subclass (config: grpo_config.py).

It uses TRL 1.16's extension points and nothing else: ``rollout_func`` (ShardRollout in
shard_rollout.py pulls whole groups from the shards), the reward function ``shard_reward`` (the
shard's reward column), and one hook, ``_generate_and_score_completions``, which replaces TRL's
advantages by per-episode ones (advantages.py) and applies importance sampling against the
recorded behaviour logprobs (``_old_policy_logps``: override it to change how pi_old is formed;
behaviour_logprobs.py, is_correction.py). ``train(resume_from_checkpoint=...)`` restores the shard
cursor. The design, with the reasons (episode advantages, loss normalisation, truncation, ranks,
pi_old under the server's sampling): docs/training.md.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint
from trl import GRPOTrainer

from trainer.advantages import episode_advantages
from trainer.behaviour_logprobs import Transform, sampled_token_logprobs
from trainer.grpo_config import PolarGRPOConfig
from trainer.is_correction import is_ratio_lost
from trainer.row_exclusions import REASONS, ExclusionLedger
from trainer.row_temperature import generation_default
from trainer.shard_rollout import ShardRollout, shard_reward
from trainer.shard_source import ShardCursor, ShardSource
from trainer.weight_sync import WeightSyncCallback

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
        self.exclusions = ExclusionLedger(args.max_excluded_share, args.excluded_share_window)
        self.shard_rollout = ShardRollout(source, args.num_generations, args.group_size_policy,
                                          args.shard_wait_timeout, args.temperature, served_t,
                                          is_correction=args.vllm_importance_sampling_correction,
                                          max_length=max_length, mask_truncated=args.mask_truncated_completions,
                                          max_realign_share=args.max_realign_share, ledger=self.exclusions)
        self.polar_is_stats: dict[str, float] = {}
        self._polar_kept_added: torch.Tensor | None = None  # (B, T): sampled tokens added to the kept set
        callbacks = [ShardCursorCallback(source), *(callbacks or [])]
        if args.sync_server:
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
        # The rollout masks truncated episodes by their recorded termination (shard_rollout.py); TRL's own rule
        # (last token not EOS) would mask segments that end in a tool result and miss length stops.
        self.mask_truncated_completions = False
        self._polar_rewards_per_func: torch.Tensor | None = None
        self._polar_late: tuple[Counter, dict] = (Counter(), {})  # this batch's tokens zeroed by the correction

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
        self._polar_late = (Counter(), {})
        if self.args.vllm_importance_sampling_correction:
            self._apply_behaviour_is(output, metrics)
        self.exclusions.add_late(*self._polar_late)  # closes this batch in the excluded-share window
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
        """Scale the advantages by the importance ratio. Mask and count, never abort: every trainable token
        the correction gives weight 0 is counted by reason in the excluded share (``_count_lost``; a token
        whose pi_old or mu is not finite also leaves the loss), realigned rows are corrected or exempt
        (``realign_is``; their share counted), and every statistic goes to TRL's metrics
        (docs/training.md: Metrics)."""
        behaviour = output.get("sampling_per_token_logps")
        if behaviour is None:
            raise RuntimeError("rollout returned no behaviour logprobs; cannot apply importance sampling")
        if "tool_mask" not in output:
            output["tool_mask"] = torch.ones_like(output["completion_mask"])
        mask = output["completion_mask"] * output["tool_mask"]
        self._polar_kept_added = None
        self._check_opsm(self.shard_rollout.batch_transforms)
        old = self._old_policy_logps(output, self.shard_rollout.batch_transforms)
        train = mask.bool()
        n_train = int(train.sum())
        added = self._polar_kept_added
        n_added = int((added & train).sum()) if added is not None else 0
        metrics["polar/is_tokens_outside_kept_set"].append(n_added)
        metrics["polar/is_kept_set_fix_share"].append(n_added / n_train if n_train else 0.0)
        realign = torch.tensor([x > 0 for x in self.shard_rollout.batch_realign], dtype=torch.bool,
                               device=mask.device)
        if realign.numel() != mask.size(0):
            raise RuntimeError(f"{realign.numel()} realign flags for {mask.size(0)} rows: the rollout and the batch "
                               "disagree")
        args = self.args
        # Realigned rows (a re-rendered context below the realign gate): corrected on the row's context
        # (realign_is=correct) or exempt (ratio 1). The *_exempt_* metrics count only the rows really exempt.
        realign_tokens = int(train[realign].sum())
        realign_rows = int((realign & (train.sum(1) > 0)).sum())
        exempt = args.realign_is == "exempt"
        metrics["polar/is_realign_token_share"].append(realign_tokens / n_train if n_train else 0.0)
        metrics["polar/is_realign_rows"].append(realign_rows)
        metrics["polar/is_realign_exempt_token_share"].append(realign_tokens / n_train if n_train and exempt else 0.0)
        metrics["polar/is_realign_exempt_rows"].append(realign_rows if exempt else 0)
        ratio, stats, lost = is_ratio_lost(old, behaviour, mask, args.vllm_importance_sampling_mode,
                                           args.vllm_importance_sampling_clip_min,
                                           args.vllm_importance_sampling_clip_max,
                                           exempt=realign if args.realign_is == "exempt" else None)
        own_bad = train & ~torch.isfinite(old.float() - behaviour.float())  # the tokens themselves
        self._count_lost(output, lost, own_bad, n_train, args.vllm_importance_sampling_mode)
        if self.loss_type == "vespo":
            output["importance_sampling_ratio"] = ratio
        else:
            adv = output["advantages"]
            output["advantages"] = (adv.unsqueeze(1) if adv.dim() == 1 else adv) * ratio
        self.polar_is_stats = stats
        # TRL's metric names for its vLLM correction, plus raw_mean, clipped_frac, masked_frac, nonfinite_*.
        for k, v in stats.items():
            if k.startswith("logp_diff_"):
                metrics[f"sampling/sampling_logp_difference/{k.removeprefix('logp_diff_')}"].append(v)
            elif k.startswith("nonfinite_") or k in ("lost_token_share", "vanishing_weight_share"):
                metrics[f"polar/is_{k}"].append(v)
            else:
                metrics[f"sampling/importance_sampling_ratio/{k}"].append(v)

    def _check_opsm(self, transforms: list[Transform]) -> None:
        """TRL's off-policy sequence mask reads mean(log mu - log pi) per sequence with pi the full softmax at
        ``temperature``: it is the staleness only when mu is a full softmax too (untruncated rows:
        ``scaled`` logprobs, or sampling without top_k/top_p/min_p). On truncated rows it reads the kept
        mass (0.02-0.09 per token on-policy, 6.5 on the random tiny model) and drops negative-advantage
        sequences for it: refused."""
        if self.args.off_policy_mask_threshold is None:
            return
        bad = [t for t in transforms if t is not None and t.truncates]
        if bad:
            raise ValueError(
                f"off_policy_mask_threshold {self.args.off_policy_mask_threshold:g} (TRL's off-policy sequence mask) "
                f"on {len(bad)} of {len(transforms)} rows sampled with truncation ({bad[0]}): their behaviour logprobs "
                "are those of the truncated, renormalised distribution the server sampled from, while the mask "
                "compares them with the policy's full softmax, so it would read the kept mass (0.02-0.09 per token "
                "on-policy) as off-policyness and drop negative-advantage sequences for it. Unset "
                "off_policy_mask_threshold, or sample untruncated (top_k -1, top_p 1, min_p 0) or with scaled "
                "logprobs (SGLang), where both sides are full softmaxes.")

    def _count_lost(self, output: dict, lost: dict, own_bad: torch.Tensor, n_train: int, mode: str) -> None:
        """Count every trainable token the correction gave weight 0, by reason, in the exclusion ledger
        (``polar/excluded_share`` and the ``max_excluded_share`` stop see it). A token whose own pi_old or
        mu is not finite also leaves the loss (tool_mask 0); the others (a *_mask band, the rest of a
        failed sequence) keep their place in the loss's normaliser with weight 0, as TRL's correction does,
        so the loss stays TRL's."""
        counts = Counter({reason: int(m.sum()) for reason, m in lost.items() if bool(m.any())})
        if not counts:
            return
        if bool(own_bad.any()):
            output["tool_mask"] = output["tool_mask"].masked_fill(own_bad, 0)
        unit = "tokens (whole sequences)" if mode.startswith("sequence") else "tokens"
        self._polar_late = (counts, {
            reason: f"{n} of {n_train} trainable {unit} of the last batch ({mode})" for reason, n in counts.items()})
        log.warning("importance sampling gave %d of %d trainable tokens weight 0 (%s): counted in the excluded share",
                    sum(counts.values()), n_train, ", ".join(f"{k} {v}" for k, v in counts.items()))

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
        added = torch.zeros(b, t, dtype=torch.bool, device=completion.device)
        bs = self.args.per_device_train_batch_size
        cut_dtype = getattr(torch, self.args.server_logits_dtype) if self.args.server_logits_dtype else None
        for s in range(0, b, bs):
            # As TRL's _get_per_token_logps_and_entropies: the logits that predict each completion token.
            logits = self.model(input_ids=ids[s:s + bs], attention_mask=attn[s:s + bs],
                                logits_to_keep=t + 1).logits[:, :-1][:, -t:]
            for j in range(logits.size(0)):
                pos = mask[s + j].nonzero().squeeze(-1)
                if pos.numel():
                    out[s + j, pos], added[s + j, pos] = sampled_token_logprobs(
                        logits[j, pos], completion[s + j, pos], transforms[s + j], cut_dtype=cut_dtype)
            del logits
        self._polar_kept_added = added
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
        src_dropped = src.dropped
        load, wait = src.load_seconds - load0, src.wait_seconds - wait0
        metrics["polar/shard_load_s"].append(load)
        metrics["polar/shard_wait_s"].append(wait)
        metrics["polar/rollout_s"].append(seconds)
        metrics["polar/groups_total"].append(st.groups)
        metrics["polar/rows_padded_total"].append(st.rows_padded)
        metrics["polar/groups_skipped_total"].append(sum(st.skipped.values()))
        metrics["polar/rows_excluded_sampling_total"].append(
            sum(v for k, v in st.rows_excluded.items() if k != "too_long"))
        ex = self.exclusions
        metrics["polar/excluded_share"].append(ex.share)  # over the window (row_exclusions.py)
        metrics["polar/excluded_tokens_share_total"].append(
            sum(ex.excluded_tokens.values()) / ex.tokens if ex.tokens else 0.0)
        for reason in REASONS:
            metrics[f"polar/excluded_rows_total/{reason}"].append(ex.excluded_rows.get(reason, 0))
            metrics[f"polar/excluded_tokens_total/{reason}"].append(ex.excluded_tokens.get(reason, 0))
        metrics["polar/rows_null_version_total"].append(st.rows_null_version)
        metrics["polar/groups_lag_unknown_total"].append(st.groups_lag_unknown)
        for reason in ("incomplete", "policy_lag", "unknown_version", "spans_versions"):
            metrics[f"polar/groups_dropped_total/{reason}"].append(src_dropped.get(reason, 0))
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
