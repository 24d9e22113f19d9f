"""Shards for the trainer tests: rows and files in the contract's format come from polar_recon.testing
(re-exported here); `Sampler` makes real sequences: Qwen3 chat-template prompts from the real
tokenizer, completions sampled from the tiny Qwen3 model with their logprobs recorded as a server
would (processed or scaled, after temperature and optional top-k/top-p), tool turns (mask 0) in between for
multi-turn episodes.
"""
from __future__ import annotations

from pathlib import Path

import torch

from polar_contracts.shards import SHARD_SCHEMA
from polar_recon.testing import row, synthetic_seq, write_shard

__all__ = ["SHARD_SCHEMA", "Sampler", "row", "synthetic_seq", "write_shard"]


class Sampler:
    """Samples completions from the tiny model and records the behaviour logprobs."""

    def __init__(self, model_dir: Path, seed: int = 0, temperature: float = 1.0, top_k: int = -1,
                 top_p: float = 1.0, logprobs: str = "processed"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.gen = torch.Generator().manual_seed(seed)
        self.temperature, self.top_k, self.top_p, self.logprobs = temperature, top_k, top_p, logprobs

    @property
    def columns(self) -> dict:
        """The shard's sampling columns for what this sampler does."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "min_p": 0.0,
                "logprobs_mode": self.logprobs}

    def kept(self, z: torch.Tensor) -> torch.Tensor:
        """The tokens top-k then top-p keep, written independently of trainer/behaviour_logprobs.py: walk down
        from the most likely token; top-k keeps ties with the k-th; top-p keeps a token while the
        (top-k renormalised) mass above it is < top_p."""
        order = torch.argsort(z, descending=True)
        keep = torch.ones_like(z, dtype=torch.bool)
        if self.top_k > 0:
            keep = z >= z[order[self.top_k - 1]]
        if self.top_p < 1:
            p = torch.where(keep, z, torch.tensor(-float("inf"))).softmax(-1)
            above = 0.0
            for i in order.tolist():
                if not keep[i]:
                    break
                if above >= self.top_p:
                    keep[i] = False
                above += float(p[i])
            keep[order[0]] = True
        return keep

    def prompt(self, text: str) -> list[int]:
        return list(self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False))

    @torch.no_grad()
    def sample(self, prefix: list[int], n: int) -> tuple[list[int], list[float]]:
        ids, lps = list(prefix), []
        for _ in range(n):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float() / self.temperature
            sampled = torch.log_softmax(logits.masked_fill(~self.kept(logits), -float("inf")), -1)
            tok = int(torch.multinomial(sampled.exp(), 1, generator=self.gen))
            ids.append(tok)
            # processed: the distribution sampled from; scaled (SGLang): temperature only, before truncation
            lps.append(float(sampled[tok] if self.logprobs == "processed" else torch.log_softmax(logits, -1)[tok]))
        return ids[len(prefix):], lps

    def episode(self, text: str, turns: int = 1, n_tokens: int = 6) -> dict:
        """One segment: prompt, then `turns` sampled spans separated by tool-result tokens."""
        ids = self.prompt(text)
        mask = [0] * len(ids)
        lps = [0.0] * len(ids)
        p = len(ids)
        for t in range(turns):
            if t:
                tool = self.tok.encode(f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{t}\n</tool_response>"
                                       f"<|im_end|>\n<|im_start|>assistant\n")
                ids += tool
                mask += [0] * len(tool)
                lps += [0.0] * len(tool)
            c, c_lp = self.sample(ids, n_tokens)
            ids += c
            mask += [1] * len(c)
            lps += c_lp
        return {"input_ids": ids, "loss_mask": mask, "logprobs": lps, "prompt_len": p, "n_calls": turns}
