"""What the trainer cannot correct: per-row reasons (counted, the row's episode excluded), the
excluded-share window, and the stop past a threshold that names the cause and the fix.

A single row never stops a run. Each row is resolved to the transform its logprobs reflect
(behaviour_logprobs.py) or to a reason, one of ``REASONS``:

- ``greedy``: sampled at temperature 0. Those tokens are argmax picks, not draws from the distribution
  the ratio (and the policy gradient) assumes; a T=1 transform would train them as samples.
- ``temperature_mismatch``: the row's logprob temperature is not the trainer's ``--temperature``
  (row_temperature.py): the ratio would measure the temperature, not the policy.
- ``logprobs_raw`` / ``logprobs_unknown``: raw logprobs (stock vLLM's default) or an unknown mode: no
  old-policy side can be formed (with the IS correction on).
- ``sampling_unsupported``: penalties, logit bias, ... the row does not record (with the correction on).
- ``unknown_truncation``: null top_k / top_p / min_p (with the correction on).
- ``realign_share``: more than ``max_realign_share`` of the row's tokens were re-rendered before a later
  call (``realign_tokens``): the row's context is not what the server sampled on.

The cause is per row, but the row's episode shares one reward and the group one baseline, so the
whole episode is excluded (shard_rollout.py ``resolve_sampling``); the group trains if it keeps two
episodes. What the importance correction zeroes later, in the trainer (grpo_trainer.py, is_correction.py
``is_ratio_lost``), is counted here too, in trainable tokens: ``nonfinite_logprob`` (a non-finite pi_old
or mu: the token, or in a sequence_* mode its whole sequence), ``is_ratio_high`` / ``is_ratio_low`` (a
*_mask mode's band zeroed the token or its sequence).

The window: the excluded share is excluded trainable tokens / trainable tokens read, over the last
``window`` trainable tokens read by this rank (whole groups; excluded ones included). Once the window
is full, a share above ``max_share`` stops training (``ExcludedShareError``, raised inside the
rollout, so every rank stops together through the lockstep of shard_rollout.py) with each reason's
share and its fix.
"""
from __future__ import annotations

from collections import Counter, deque

from polar_contracts.sampling_fields import GREEDY_EPS
from trainer.behaviour_logprobs import FIX, LogprobsModeError, Transform, row_transform
from trainer.row_temperature import TOLERANCE, logprob_temperature

REASONS = ("greedy", "temperature_mismatch", "logprobs_raw", "logprobs_unknown", "sampling_unsupported",
           "unknown_truncation", "realign_share", "nonfinite_logprob", "is_ratio_high", "is_ratio_low")

FIXES = {
    "greedy": "sample with temperature > 0 (the harness or the server's generation_config asks for greedy "
              "decoding; argmax tokens are not samples of the policy)",
    "temperature_mismatch": "pass the server's sampling temperature as --temperature",
    "logprobs_raw": FIX,
    "logprobs_unknown": FIX + "; give the proxy polar_generation_config (or a server it can probe) so it "
                        "records the mode",
    "sampling_unsupported": "drop the penalties / logit_bias / structured output from the harness's requests "
                            "(and the server's defaults), or train without the correction "
                            "(--vllm_importance_sampling_correction false)",
    "unknown_truncation": "the proxy could not learn the server's sampling defaults (the row's sampling_source "
                          "says why): start the proxy with --set polar_generation_config=<the served model's "
                          "directory or its generation_config.json> (or have the harness send temperature, "
                          "top_p, top_k and min_p)",
    "realign_share": "build the shards with `polar-recon build --strategy per-call` (every row's context is "
                     "what the server saw) or raise --max_realign_share",
    "nonfinite_logprob": "check the server's reported logprobs and the trainer's numerics (non-finite pi_old "
                         "or behaviour logprobs; in a sequence_* mode one such token fails its sequence: "
                         "--vllm_importance_sampling_mode token_truncate loses the token alone)",
    "is_ratio_high": "the importance ratio exceeded --vllm_importance_sampling_clip_max under a *_mask mode: "
                     "a sequence ratio is a product over the row, so long rows leave any band on numerics alone; "
                     "use --vllm_importance_sampling_mode token_truncate (the default) or lower --max_policy_lag",
    "is_ratio_low": "the importance ratio fell below --vllm_importance_sampling_clip_min under a *_mask mode: "
                    "use --vllm_importance_sampling_mode token_truncate (the default), widen the band, or lower "
                    "--max_policy_lag",
}


def explain_excluded(rows: Counter, details: dict[str, str]) -> str:
    """Each reason rows were excluded for, with its last detail and its fix (for a stop message)."""
    parts = []
    for reason, n in rows.most_common():
        fix = FIXES.get(reason)
        parts.append(f"{reason}: {n} rows ({details.get(reason, '')})" + (f". Fix: {fix}" if fix else ""))
    return "; ".join(parts)


class ExcludedShareError(RuntimeError):
    """Too large a share of the trainable tokens was excluded: the message names causes and fixes."""


def trainable_tokens(row: dict) -> int:
    """A shard row's trainable tokens (loss_mask 1 after prompt_len)."""
    return int(sum(row["loss_mask"][row["prompt_len"]:]))


def realign_share(row: dict) -> float:
    """The share of the row's tokens that were re-rendered before a later call (0 when unknown)."""
    n = row.get("realign_tokens") or 0
    return n / max(1, len(row["input_ids"]))


def resolve_row(row: dict, *, trainer_temperature: float | None, served_default_temperature: float,
                is_correction: bool, max_realign_share: float | None, where: str = "row"
                ) -> tuple[Transform | None, str, str]:
    """(transform, "", "") for a row to train (transform None when the correction is off), else
    (None, reason, detail): reason in REASONS."""
    t_req = row.get("temperature")
    t_eff = served_default_temperature if t_req is None else float(t_req)
    if "temperature" in row and t_eff < GREEDY_EPS:
        return None, "greedy", "sampled greedily (temperature 0)"
    if trainer_temperature is not None and "temperature" in row:  # older shards lack the column: unchecked
        t = logprob_temperature(t_req, served_default_temperature)
        if abs(t - trainer_temperature) > TOLERANCE:
            how = "the server's default" if t_req is None else "requested"
            return None, "temperature_mismatch", (f"sampled at temperature {t:g} ({how}), the trainer computes "
                                                  f"at {trainer_temperature:g}: pass --temperature {t:g}")
    share = realign_share(row)
    if max_realign_share is not None and share > max_realign_share:
        return None, "realign_share", (f"{share:.0%} of its tokens re-rendered ({row.get('realign_classes')}) > "
                                       f"max_realign_share {max_realign_share:g}")
    if not is_correction:
        return None, "", ""
    try:
        t, why = row_transform(row, served_default_temperature, where)
    except LogprobsModeError as e:
        return None, "logprobs_raw" if row.get("logprobs_mode") == "raw" else "logprobs_unknown", str(e)
    if t is None:
        return None, "unknown_truncation" if why.startswith("unknown") else "sampling_unsupported", why
    return t, "", ""


class ExclusionLedger:
    """Trainable tokens read and excluded by reason: cumulative, and over the last ``window`` tokens."""

    def __init__(self, max_share: float | None, window: int):
        if max_share is not None and not 0.0 <= max_share <= 1.0:
            raise ValueError(f"max_excluded_share must be in [0, 1] (or None), got {max_share}")
        if window < 1:
            raise ValueError(f"excluded_share_window must be >= 1 token, got {window}")
        self.max_share, self.window = max_share, window
        self.tokens = 0  # trainable tokens read, cumulative
        self.excluded_tokens: Counter = Counter()  # by reason, cumulative
        self.excluded_rows: Counter = Counter()
        self.details: dict[str, str] = {}  # the last detail per reason (for the stop message)
        self._recent: deque[tuple[int, Counter]] = deque()
        self._recent_tokens = 0
        self._recent_excluded: Counter = Counter()
        # the batch read since the last add_late (the one the trainer is about to correct): entries, totals
        self._open, self._open_tokens, self._open_excluded = 0, 0, Counter()

    def add(self, tokens: int, excluded: Counter, rows: Counter | None = None,
            details: dict[str, str] | None = None) -> None:
        """One group read (``tokens`` trainable tokens, of which ``excluded`` by reason), or (tokens 0)
        tokens masked later, in the trainer (the trainer uses ``add_late``, which keeps them with the
        tokens they were found in)."""
        self.tokens += tokens
        self.excluded_tokens.update(excluded)
        self.excluded_rows.update(rows or {})
        self.details.update(details or {})
        self._recent.append((tokens, Counter(excluded)))
        self._recent_tokens += tokens
        self._recent_excluded.update(excluded)
        self._open += 1
        self._open_tokens += tokens
        self._open_excluded.update(excluded)
        self._slide()

    def add_late(self, excluded: Counter, details: dict[str, str] | None = None) -> None:
        """Close the batch read since the last ``add_late`` (the trainer calls it once per batch, with or
        without the correction): ``excluded`` are its tokens the trainer zeroed later (the importance
        correction: is_correction.py ``is_ratio_lost``), by reason. The batch's groups and these become one
        window entry, so the window never counts excluded tokens whose reading slid out of it (a batch of
        long rows can be larger than the window: the window then holds that batch)."""
        self.excluded_tokens.update(excluded)
        self.details.update(details or {})
        for _ in range(min(self._open, len(self._recent))):  # the batch's entries still in the window
            n, ex = self._recent.pop()
            self._recent_tokens -= n
            self._recent_excluded.subtract(ex)
        merged = self._open_excluded + Counter(excluded)
        self._recent.append((self._open_tokens, merged))
        self._recent_tokens += self._open_tokens
        self._recent_excluded.update(merged)
        self._open, self._open_tokens, self._open_excluded = 0, 0, Counter()
        self._slide()

    def _slide(self) -> None:
        while len(self._recent) > 1 and self._recent_tokens - self._recent[0][0] >= self.window:
            n, ex = self._recent.popleft()
            self._recent_tokens -= n
            self._recent_excluded.subtract(ex)

    @property
    def share(self) -> float:
        """The excluded share over the window (0 before any token)."""
        return min(1.0, sum(self._recent_excluded.values()) / self._recent_tokens) if self._recent_tokens else 0.0

    def check(self, where: str = "") -> None:
        """Raise ExcludedShareError when the window is full and its excluded share is above max_share."""
        if self.max_share is None or self._recent_tokens < self.window or self.share <= self.max_share:
            return
        parts = [f"{reason}: {n / self._recent_tokens:.1%} ({self.details.get(reason, '')}). Fix: {FIXES[reason]}"
                 for reason, n in self._recent_excluded.most_common() if n > 0]
        raise ExcludedShareError(
            f"{where}{self.share:.1%} of the last {self._recent_tokens} trainable tokens were excluded "
            f"(> max_excluded_share {self.max_share:g}): the trainer would learn from what is left, a biased "
            f"subset. Causes: " + "; ".join(parts) + ". (Raise --max_excluded_share to train on anyway.)")
