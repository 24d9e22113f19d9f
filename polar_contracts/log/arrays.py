"""The one reader of an episode log's calls (`decode_log`), and its numpy view (`read_calls`).

`decode_log` reads a file once: the call rows (log/table.py's batch reader), the end record
(log/end_record.py), the prefix compression undone into int32 arrays (log/table.py
`full_sequences`), the requests rebuilt and the recipe's auxiliary rules applied. `read_calls`
turns that into `Call`s with numpy views, reconstruction's hot path; `read_episode`
(log/reader.py) is the polars view of the same decode. The end record alone (grouping, polling a
log until it ends) is `read_head` (log/end_record.py), which decodes no call.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from polar_contracts.auxiliary import AuxiliaryRuleError, first_match, rules_from_metadata
from polar_contracts.episode_ids import episode_id_of, is_log_file
from polar_contracts.log.end_record import EndRecord, EpisodeHead, end_record_of, read_head
from polar_contracts.log.schema import KIND_CALL
from polar_contracts.log.table import LogError, full_requests, full_sequences, list_column, read_table
from polar_contracts.sampling_fields import COLUMNS as SAMPLING_COLUMNS
from polar_contracts.sampling_fields import PARAMS, request_params

# Columns kept per call besides the ids (small scalars only: the hot path never parses JSON).
_SCALARS = ("call_index", "choice", "api", "dialect", "model", "status", "error", "stream", "t_start",
            "t_first_byte", "t_end", "finish_reason", "weight_version", "auxiliary", *SAMPLING_COLUMNS)


@dataclass
class Call:
    row: int  # position among the file's call rows
    call_index: int
    prompt: np.ndarray | None  # int32, full prompt ids as the server tokenized them
    completion: np.ndarray | None  # int32, the ids the model sampled
    logprobs: np.ndarray | None  # float32, one per completion id
    info: dict[str, Any]  # the scalar columns of _SCALARS
    seq: np.ndarray | None = None  # prompt + completion, contiguous (prompt and completion are views of it)
    # The writer's prefix compression: this prompt shares exactly `base_len` leading tokens with
    # the prompt+completion of call row `base_row` (its longest match among recent rows). A hint
    # that spares linking most comparisons; never trusted for more than that one length.
    base_row: int = -1
    base_len: int = 0

    @property
    def usable(self) -> bool:
        """A call that can train: complete, with ids, and part of the agent's trajectory."""
        return (
            self.prompt is not None
            and self.completion is not None
            and self.logprobs is not None
            and not self.info.get("error")
            and not self.info.get("auxiliary")
        )

    @property
    def why_unusable(self) -> str | None:
        if self.info.get("auxiliary"):
            return "auxiliary"
        if self.info.get("error"):
            return f"error: {self.info['error']}"
        if self.prompt is None or self.completion is None:
            return "no token ids"
        if self.logprobs is None:
            return "no logprobs"
        return None


@dataclass
class Episode:
    path: Path
    episode_id: str
    calls: list[Call]
    finished: bool
    reward: float | None
    metadata: dict[str, Any]
    truncated: bool
    requests: list[str | None] = field(default_factory=list)  # per call row, JSON text (lazy users)


# EpisodeHead and read_head (the end record alone) live in log/end_record.py; these names stay
# importable from here, where reconstruction has always found them.
__all__ = ["Call", "DecodedLog", "Episode", "EpisodeHead", "calls_of", "decode_log", "list_logs", "read_calls",
           "read_head"]


def list_logs(logdir: str | os.PathLike) -> list[Path]:
    d = Path(logdir)
    if not d.is_dir():
        raise LogError(f"{d}: not a directory")
    return sorted(p for p in d.iterdir() if is_log_file(p))


@dataclass
class DecodedLog:
    """One log file decoded once; every view (read_calls, read_episode) is built from this."""
    path: Path
    calls: pa.Table  # the call rows in file order, on-disk SCHEMA (end and incomplete rows removed)
    end: EndRecord
    torn: bool  # a torn last batch was cut off (writer killed mid-write)
    seqs: list[np.ndarray | None]  # per call row: prompt + completion, int32 (None: no ids)
    prompt_lens: list[int]  # per call row: the prompt's length within seqs[i]
    base_rows: list[int | None]  # per call row: the writer's prefix-compression hint (see Call)
    base_lens: list[int | None]
    requests: list[str | None]  # per call row: the request JSON text as the harness sent it
    auxiliary_rules: list[str | None]  # per call row: the recipe's auxiliary rule it matches, if any


def decode_log(path: str | os.PathLike) -> DecodedLog:
    """Read and decode one log file. Raises LogError naming the file."""
    path = Path(path)
    try:
        return _decode(path)
    except LogError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise LogError(f"{path}: {exc}") from exc  # table.py's decoders do not know the file
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        raise LogError(f"{path}: cannot read ({exc})") from exc


def _decode(path: Path) -> DecodedLog:
    table, torn = read_table(path)
    end = end_record_of(table, path)
    try:
        # the recipe's own description of its auxiliary calls, sent by the rollout node (auxiliary.py)
        aux_rules = rules_from_metadata(end.metadata, str(path))
    except AuxiliaryRuleError as exc:
        raise LogError(str(exc)) from exc
    # (to_pylist: to_numpy on a string column imports pandas, ~0.6 s)
    is_call = np.asarray([k == KIND_CALL for k in table.column("kind").to_pylist()], dtype=bool)
    n_calls = int(is_call.sum())
    if is_call[:n_calls].all():  # the usual layout: calls, then the end record: a zero-copy slice
        calls_t = table.slice(0, n_calls)
    else:
        calls_t = table.filter(pa.array(is_call))
    seqs, prompt_lens = full_sequences(calls_t)
    # request text is delta-coded on disk: rebuilt for every row, parsed only where a rule needs it
    requests = full_requests(calls_t)
    rules: list[str | None] = [None] * calls_t.num_rows
    if aux_rules:
        flagged = calls_t.column("auxiliary").to_pylist()
        apis = calls_t.column("api").to_pylist()
        rules = [None if a else first_match(aux_rules, api, req)
                 for a, api, req in zip(flagged, apis, requests, strict=True)]
    return DecodedLog(path, calls_t, end, torn, seqs, prompt_lens, calls_t.column("prompt_base_row").to_pylist(),
                      calls_t.column("prompt_base_len").to_pylist(), requests, rules)


def read_calls(path: str | os.PathLike, *, with_requests: bool = False) -> Episode:
    """The whole episode with full prompts as int32 arrays. Raises LogError naming the file."""
    return calls_of(decode_log(path), with_requests=with_requests)


def calls_of(log: DecodedLog, *, with_requests: bool = False) -> Episode:
    """The numpy view of a decoded log: one Call per call row, sorted by (call_index, choice)."""
    calls_t = log.calls
    lps = list_column(calls_t.column("completion_logprobs"), np.float32)
    has_completion = calls_t.column("completion_ids").is_valid().to_pylist()
    scalars = {c: calls_t.column(c).to_pylist() for c in _SCALARS}
    calls: list[Call] = []
    for i in range(calls_t.num_rows):
        seq, n_prompt = log.seqs[i], log.prompt_lens[i]
        prompt = completion = None
        base, n = -1, 0
        if seq is not None:
            prompt = seq[:n_prompt]
            completion = seq[n_prompt:] if has_completion[i] else None
            base = -1 if log.base_rows[i] is None else log.base_rows[i]
            n = log.base_lens[i] or 0
        info = {c: scalars[c][i] for c in _SCALARS}
        if log.auxiliary_rules[i] is not None:
            info["auxiliary"], info["auxiliary_rule"] = True, log.auxiliary_rules[i]
        request = log.requests[i]
        if request is not None and any(info[k] is None for k in PARAMS):
            # a v2 log (no sampling columns) or an unknown default: what the request set itself
            # is what the server applied (the rest stays unknown)
            for k, v in request_params(request).items():
                if info[k] is None:
                    info[k] = v
        lp = lps[i]
        if completion is not None and lp is not None and len(lp) != len(completion):
            info["error"] = info.get("error") or f"{len(lp)} logprobs for {len(completion)} completion ids"
        index = int(info["call_index"]) if info["call_index"] is not None else i
        calls.append(Call(i, index, prompt, completion, lp, info, seq, base, n))
    calls.sort(key=lambda c: (c.call_index, c.info.get("choice") or 0))
    end = log.end
    return Episode(log.path, episode_id_of(log.path), calls, end.finished, end.reward, end.metadata, log.torn,
                   log.requests if with_requests else [])
