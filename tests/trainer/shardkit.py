"""Build shards in the exact contract format (polar-recon's, see trainer/shard_source.py) for tests.

Sequences are real: Qwen3 chat-template prompts from the real tokenizer, completions sampled from
the tiny Qwen3 model with their logprobs recorded as a server would, tool turns (mask 0) in
between for multi-turn episodes.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[2]

SHARD_SCHEMA = pa.schema([
    ("episode_id", pa.string()), ("group_id", pa.string()), ("segment", pa.int32()),
    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("logprobs", pa.list_(pa.float32())),
    ("prompt_len", pa.int32()), ("reward", pa.float64()), ("n_calls", pa.int32()), ("strategy", pa.string()),
    ("n_realign", pa.int32()), ("weight_version", pa.string()), ("model", pa.string()),
    ("group_size", pa.int32()), ("group_complete", pa.bool_()),
])


def tiny_model_dir() -> Path:
    """The shared tiny Qwen3 (tests/support/servers.py) when it exists, else built here once."""
    try:
        from tests.support.servers import tiny_model_dir as shared
        return Path(shared())
    except ImportError as e:
        print(f"[tests/trainer] tests.support.servers.tiny_model_dir unavailable ({e}); building locally",
              file=sys.stderr)
    from polar_serve.tiny import make_tiny

    d = ROOT / ".cache" / "tiny-qwen3-trainer"
    if not (d / "config.json").is_file():
        tmp = d.with_name(d.name + f".tmp{os.getpid()}")
        make_tiny(tmp)
        try:
            os.replace(tmp, d)
        except OSError:  # another test process built it first
            shutil.rmtree(tmp, ignore_errors=True)
    return d


class Sampler:
    """Samples completions from the tiny model and records the behaviour logprobs."""

    def __init__(self, model_dir: Path, seed: int = 0, temperature: float = 1.0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.gen = torch.Generator().manual_seed(seed)
        self.temperature = temperature

    def prompt(self, text: str) -> list[int]:
        return list(self.tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                 add_generation_prompt=True, return_dict=False))

    @torch.no_grad()
    def sample(self, prefix: list[int], n: int) -> tuple[list[int], list[float]]:
        ids, lps = list(prefix), []
        for _ in range(n):
            logits = self.model(torch.tensor([ids])).logits[0, -1].float() / self.temperature
            logp = torch.log_softmax(logits, -1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=self.gen))
            ids.append(tok)
            lps.append(float(logp[tok]))
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


def row(seq: dict, episode_id: str, group_id: str, reward: float, *, segment: int = 0, group_size: int = 1,
        weight_version: str | None = "1", complete: bool = True) -> dict:
    return {"episode_id": episode_id, "group_id": group_id, "segment": segment, "input_ids": seq["input_ids"],
            "loss_mask": seq["loss_mask"], "logprobs": seq["logprobs"], "prompt_len": seq["prompt_len"],
            "reward": reward, "n_calls": seq.get("n_calls", 1), "strategy": "token", "n_realign": 0,
            "weight_version": weight_version, "model": "tiny-qwen3", "group_size": group_size,
            "group_complete": complete}


def synthetic_seq(prompt: list[int], completion: list[int], logprob: float = -1.0) -> dict:
    ids = list(prompt) + list(completion)
    return {"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(completion),
            "logprobs": [0.0] * len(prompt) + [logprob] * len(completion), "prompt_len": len(prompt)}


def write_shard(out_dir, seq_no: int, rows: list[dict], filesystem=None) -> str:
    """Write to a temporary name, then rename: exactly what polar-recon does. Returns the final name."""
    name = f"shard-{seq_no:06d}.parquet"
    table = pa.Table.from_pylist(rows, schema=SHARD_SCHEMA)
    if filesystem is None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, out / name)
    else:
        base = str(out_dir).rstrip("/")
        filesystem.create_dir(base, recursive=True)
        pq.write_table(table, f"{base}/.{name}.tmp", filesystem=filesystem)
        filesystem.move(f"{base}/.{name}.tmp", f"{base}/{name}")
    return name


def group_rows(group_id: str, n_episodes: int, rewards: list[float], seq_fn, **kw) -> list[dict]:
    return [row(seq_fn(i), f"{group_id}-e{i}", group_id, rewards[i], group_size=n_episodes, **kw)
            for i in range(n_episodes)]


def now() -> float:
    return time.time()
