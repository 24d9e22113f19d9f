"""A vLLM V1 logits processor that makes the served model emit a given token sequence (vLLM unchanged).

Loaded by vLLM itself, in vLLM's own environment: this file imports only torch and vllm, and its
folder (harness_recipes/demo/vllm_plugin/, nothing else in it) is put on vLLM's PYTHONPATH with

    --logits-processors polar_forced_reply:ForcedReply

(harness_recipes.demo.forced_replies.vllm_plugin_args / vllm_plugin_env give both). A request opts in
through vLLM's own per-request field `vllm_xargs`, which vLLM copies into SamplingParams.extra_args:

    {"vllm_xargs": {"polar_forced": [token ids, the last one <|im_end|>]}}

At decode step k of such a request (k = the number of tokens it has produced so far) every logit is
set to -inf except that of `polar_forced[k]`, which is set to 0: the sampler, greedy or random,
at any temperature, top-k, top-p or min-p, can pick only that token, so vLLM *samples* exactly the
forced sequence and reports it as any other completion (token ids, text, tool-call and reasoning
parsing, finish reason: the last forced id is the end-of-turn token, so it stops there). After the
sequence (a request that ignores EOS) the row is left alone. Requests without the key, and rows of
other requests in the same batch, are untouched; the processor is not argmax-invariant, so vLLM
applies it before greedy sampling too (sampler step 5).

Logprobs: vLLM's default `--logprobs-mode raw_logprobs` computes the logprobs it returns from the
model's logits BEFORE any processing (before this processor, penalties and temperature). The
logprob a row reports for a forced token is therefore the served model's own log-softmax of it at
temperature 1: the teacher-forced logprob of the scripted reply under the model, never the 0.0 of
the one-hot distribution the token was actually drawn from (`processed_logprobs` would report that
0.0 for every token). Top-k alternatives are likewise the model's unforced ones.

Rows are tracked through vLLM's BatchUpdate (removed, then added, then moved), holding a reference
to each request's live output-token list, as vLLM's own MinTokens processor does; on the CPU
platform async scheduling is off, so its length is the step index. Speculative decoding is
refused by vLLM with any custom logits processor.
"""
from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

KEY = "polar_forced"


def forced_ids(params) -> list[int] | None:
    """The forced sequence a request's SamplingParams carry, or None."""
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(KEY) if isinstance(extra, dict) else None


class ForcedReply(LogitsProcessor):
    """Forces `vllm_xargs.polar_forced` token by token; see the module docstring."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        ids = forced_ids(sampling_params)
        if ids is None:
            return
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in ids)):
            raise ValueError(f"vllm_xargs.{KEY} must be a non-empty list of token ids (non-negative integers)")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.device = device
        # batch row -> (the forced ids, the request's live list of output token ids)
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token wins: apply it before greedy sampling as well

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            ids = forced_ids(params) if params is not None else None
            if ids:
                self.rows[index] = (list(ids), output_ids)
            else:
                self.rows.pop(index, None)  # a new request took the row of a forced one
        for a, b, direction in batch_update.moved:
            ea, eb = self.rows.pop(a, None), self.rows.pop(b, None)
            if ea is not None:
                self.rows[b] = ea
            if eb is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = eb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows, tokens = [], []
        vocab = logits.shape[-1]
        for row, (ids, output) in self.rows.items():
            k = len(output)
            if k < len(ids) and row < logits.shape[0] and ids[k] < vocab:
                rows.append(row)
                tokens.append(ids[k])
        if rows:
            r = torch.tensor(rows, dtype=torch.long, device=logits.device)
            t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
            logits[r] = float("-inf")
            logits[r, t] = 0.0
        return logits
