"""Synthetic episode logs and shards, for tests and benchmarks (as numpy.testing is for numpy).

Episode logs, made with the real Qwen3 chat template. A `Conversation` plays three parts:
- the harness: keeps the message list and, after each call, appends ITS rendition of the assistant
  turn (what real harnesses do: drop reasoning, resend whitespace content, re-serialize tool-call
  arguments; `HARNESSES`) and the tool results;
- the server: renders the request with the chat template (tool-call arguments parsed into objects
  first, as vLLM does) and tokenizes it -> prompt_ids;
- the model: "samples" a completion given as text (`Sample.text`) -> completion_ids, with logprobs.
Each call is written with EpisodeWriter, exactly as the capture addon writes it.

    conv = episode(logdir, "ep-1", two_tool_turns, harness="qwen-code", reward=1.0)

Shards in the shard contract's format (`write_shard`, named and renamed as polar-recon does; rows
from `row(synthetic_seq(prompt_ids, completion_ids), episode_id, group_id, reward)`).

Needs transformers (the tokenizer) for the logs, pyarrow for the shards; nothing here is imported
by the rest of polar_recon.
"""
from __future__ import annotations

import copy
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from polar_contracts.assets import QWEN3_TOKENIZER
from polar_contracts.log.writer import EpisodeWriter
from polar_contracts.sampling_fields import COLUMNS
from polar_contracts.sampling_fields import COLUMNS as SAMPLING_COLUMNS
from polar_contracts.shards import FIDELITY_COLUMNS, SHARD_SCHEMA, shard_name, shard_temp_name

TOKENIZER_DIR = QWEN3_TOKENIZER


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def encode(text: str) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=False)


TOOLS = [
    {"type": "function", "function": {"name": "write_file", "description": "Write a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        "required": ["path", "content"]}}},
    {"type": "function", "function": {"name": "run_shell", "description": "Run a shell command.", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
]
SYSTEM = "You are a careful coding agent. Use the tools to change files."


@dataclass
class Sample:
    """What the model samples after `<|im_start|>assistant\\n`."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments JSON text as sampled)

    def text(self, thinking: bool) -> str:
        s = f"<think>\n{self.reasoning}\n</think>\n\n" if thinking and self.reasoning else (
            "<think>\n\n</think>\n\n" if thinking else "")
        s += self.content
        for k, (name, args) in enumerate(self.tool_calls):
            s += "\n" if (k or self.content) else ""
            s += f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
        return s + "<|im_end|>"

    def parsed(self, thinking: bool) -> dict[str, Any]:
        """The server's parse (vLLM qwen3 reasoning parser + hermes tool parser): reasoning between
        the think tags, content = everything after `</think>` up to the first `<tool_call>`, unstripped."""
        text = self.text(thinking)[: -len("<|im_end|>")]
        reasoning = None
        if "</think>" in text:
            reasoning, _, text = text.partition("</think>")
            reasoning = reasoning.replace("<think>", "", 1)
        content = text.split("<tool_call>")[0] if self.tool_calls else text
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": f"call_{k}", "type": "function",
                 "function": {"name": n, "arguments": json.dumps(json.loads(a), ensure_ascii=False)}}
                for k, (n, a) in enumerate(self.tool_calls)]
        return msg


# How each harness sends an assistant turn back (docs/reference.md, "What harnesses send back").
def _strict(msg):  # resends what it received, reasoning included
    return copy.deepcopy(msg)


def _qwen_code(msg):  # drops reasoning, resends content as received, compact JSON arguments
    out = {k: v for k, v in copy.deepcopy(msg).items() if k != "reasoning_content"}
    for c in out.get("tool_calls", []):
        c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), separators=(",", ":"))
    return out


def _pi(msg):  # drops whitespace-only reasoning, keeps the rest
    out = _qwen_code(msg)
    r = msg.get("reasoning_content")
    if r and r.strip():
        out["reasoning_content"] = r
    return out


def _tidy(msg):  # strips whitespace-only content (a harness that cleans up): stays CLEAN with thinking
    out = _strict(msg)
    if out.get("content") is not None and not out["content"].strip():
        out["content"] = None
    return out


HARNESSES = {"strict": _strict, "qwen-code": _qwen_code, "pi": _pi, "tidy": _tidy}


def server_messages(messages: list[dict]) -> list[dict]:
    """vLLM parses tool-call argument strings into objects before templating."""
    out = copy.deepcopy(messages)
    for m in out:
        for c in m.get("tool_calls") or []:
            if isinstance(c["function"].get("arguments"), str):
                c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def render(messages: list[dict], tools, thinking: bool) -> str:
    return tokenizer().apply_chat_template(server_messages(messages), tools=tools, tokenize=False,
                                           add_generation_prompt=True, enable_thinking=thinking)


@dataclass
class Recorded:
    call_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    kept: bool = True  # False for a retry nobody extends, an auxiliary or failed call


class Conversation:
    def __init__(self, writer: EpisodeWriter, *, harness: str = "strict", thinking: bool = True,
                 system: str = SYSTEM, tools=TOOLS, task: str = "create hello.txt containing hi",
                 seed: int = 0, weight_version: str = "1", model: str = "qwen3-test",
                 log_fields: dict[str, Any] | None = None):
        self.w, self.harness, self.thinking, self.tools = writer, HARNESSES[harness], thinking, tools
        self.messages: list[dict] = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        self.rng = np.random.default_rng(seed)
        self.weight_version, self.model = weight_version, model
        self.recorded: list[Recorded] = []
        self.sampling: dict[str, Any] = {}  # sampling fields the harness sends (most send none)
        # columns written on every call row, e.g. the proxy's sampling columns (log schema v3):
        # {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "logprobs_mode": "processed"}
        self.log_fields: dict[str, Any] = dict(log_fields or {})

    def request(self) -> dict:
        body = {"model": self.model, "messages": copy.deepcopy(self.messages), "stream": True,
                "chat_template_kwargs": {"enable_thinking": self.thinking}, **self.sampling}
        if self.tools:
            body["tools"] = self.tools
        return body

    def call(self, sample: Sample, *, results: list[str] | None = None, keep: bool = True, **fields) -> Recorded:
        """One model call: record it; if `keep`, the harness appends the turn and tool results."""
        prompt = encode(render(self.messages, self.tools, self.thinking))
        comp = encode(sample.text(self.thinking))
        lps = (-self.rng.exponential(0.7, len(comp))).astype(np.float32)
        msg = sample.parsed(self.thinking)
        idx = self.w.next_call_index()
        self.w.append_call(
            call_index=idx, prompt_ids=prompt, completion_ids=comp, completion_logprobs=lps,
            api="chat", dialect="vllm", model=self.model, status=200, stream=True,
            t_start=1000.0 + idx, t_first_byte=1000.1 + idx, t_end=1000.5 + idx,
            request=json.dumps(self.request()), response=json.dumps({"choices": [{"message": msg}]}),
            finish_reason="tool_calls" if sample.tool_calls else "stop", weight_version=self.weight_version,
            **{**self.log_fields, **fields})
        rec = Recorded(idx, prompt, comp, lps.tolist())
        self.recorded.append(rec)
        if keep:
            self.messages.append(self.harness(msg))
            for k, r in enumerate(results or []):
                self.messages.append({"role": "tool", "tool_call_id": f"call_{k}", "content": r})
        return rec

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def compact(self, summary: str) -> None:
        """Context compaction: the history is replaced by a summary."""
        self.messages = [self.messages[0], {"role": "user", "content": f"Summary of the work so far: {summary}"}]

    def cut_off(self) -> None:
        """A call whose stream broke: the prompt is known, no completion."""
        prompt = encode(render(self.messages, self.tools, self.thinking))
        self.w.append_call(call_index=self.w.next_call_index(), prompt_ids=prompt, completion_ids=None,
                           completion_logprobs=None, api="chat", model=self.model, status=200, stream=True,
                           error="upstream closed the stream mid-response", request=json.dumps(self.request()))


def auxiliary_call(w: EpisodeWriter, text: str = "Write a 5-word title for: create hello.txt") -> None:
    """Claude Code's title call: recorded, flagged, never trained."""
    msgs = [{"role": "user", "content": text}]
    prompt = encode(render(msgs, None, False))
    comp = encode('{"title": "Create hello file"}<|im_end|>')
    w.append_call(call_index=w.next_call_index(), prompt_ids=prompt, completion_ids=comp,
                  completion_logprobs=[-0.1] * len(comp), api="chat", model="qwen3-test", auxiliary=True,
                  request=json.dumps({"messages": msgs}))


# ------------------------------------------------------------------------------------------
# the re-render cases of docs/reference.md, "What harnesses send back"


def write_tool(path="hello.txt", content="hi", compact=False) -> tuple[str, str]:
    obj = {"path": path, "content": content}
    return ("write_file", json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj))


def two_tool_turns(conv: Conversation, *, reasoning=("I should write the file.", "Check it."), content=("", ""),
                   compact_args=False) -> None:
    conv.call(Sample(reasoning[0], content[0], [write_tool(compact=compact_args)]), results=["ok"])
    conv.call(Sample(reasoning[1], content[1], [("run_shell", json.dumps({"command": "cat hello.txt"}))]),
              results=["hi"])
    conv.call(Sample("Done.", "The file hello.txt now contains hi.", []))


def episode(logdir: Path, episode_id: str, build, *, reward: float | None = 1.0, metadata=None, end=True, **kw):
    """Write one episode: `build(conv)` makes the calls. Returns the Conversation (its .recorded)."""
    w = EpisodeWriter(Path(logdir) / f"{episode_id}.arrow", episode_id)
    conv = Conversation(w, **kw)
    build(conv)
    if end:
        w.end(reward, metadata or {})
    else:
        w.close()
    return conv


# ------------------------------------------------------------------------------------------
# shards


def synthetic_seq(prompt: list[int], completion: list[int], logprob: float = -1.0) -> dict:
    """One sequence: `prompt` (mask 0) then `completion` (mask 1, every logprob `logprob`)."""
    ids = list(prompt) + list(completion)
    return {"input_ids": ids, "loss_mask": [0] * len(prompt) + [1] * len(completion),
            "logprobs": [0.0] * len(prompt) + [logprob] * len(completion), "prompt_len": len(prompt)}


def row(seq: dict, episode_id: str, group_id: str, reward: float, *, segment: int = 0, group_size: int = 1,
        weight_version: str | None = "1", complete: bool = True, realign_tokens: int | None = None,
        realign_classes: list[str] | None = None, termination: str | None = None, **sampling: Any) -> dict:
    """A shard row of `seq` (a dict with input_ids, loss_mask, logprobs, prompt_len[, n_calls]).
    ``sampling``: any of the sampling columns (``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``logprobs_mode``, ``sampling_unsupported``; see polar_contracts/sampling_fields.py); a row sets only those given.
    ``realign_tokens``, ``realign_classes``, ``termination``: the fidelity columns (shards.py), set
    only when given (a row without them reads as a shard of an older build)."""

    unknown = sampling.keys() - set(COLUMNS)
    if unknown:
        raise TypeError(f"row() got unknown columns {sorted(unknown)}; sampling columns are {COLUMNS}")
    extra = {k: v for k, v in (("realign_tokens", realign_tokens), ("realign_classes", realign_classes),
                               ("termination", termination)) if v is not None}
    return {**sampling, **extra, "episode_id": episode_id, "group_id": group_id, "segment": segment,
            "input_ids": seq["input_ids"],
            "loss_mask": seq["loss_mask"], "logprobs": seq["logprobs"], "prompt_len": seq["prompt_len"],
            "reward": reward, "n_calls": seq.get("n_calls", 1), "strategy": "token", "n_realign": 0,
            "weight_version": weight_version, "model": "tiny-qwen3", "group_size": group_size,
            "group_complete": complete}


def write_shard(out_dir, seq_no: int, rows: list[dict], filesystem=None) -> str:
    """Write shard `seq_no` to a temporary name, then rename: exactly what polar-recon does. The
    schema is the contract's (polar_contracts.shards.SHARD_SCHEMA; a key a row lacks is null), without
    the sampling columns (``temperature``, ``top_p``, ...) that no row has (``row`` sets only those
    it is given), as a shard of an older build. Returns the name."""
    import pyarrow as pa
    import pyarrow.parquet as pq


    schema = SHARD_SCHEMA
    for c in (*SAMPLING_COLUMNS, *FIDELITY_COLUMNS):
        if not any(c in r for r in rows):
            schema = schema.remove(schema.get_field_index(c))
    table = pa.Table.from_pylist(rows, schema=schema)
    name, tmp = shard_name(seq_no), shard_temp_name(seq_no)
    if filesystem is None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, out / tmp)
        os.replace(out / tmp, out / name)
    else:
        base = str(out_dir).rstrip("/")
        filesystem.create_dir(base, recursive=True)
        pq.write_table(table, f"{base}/{tmp}", filesystem=filesystem)
        filesystem.move(f"{base}/{tmp}", f"{base}/{name}")
    return name
