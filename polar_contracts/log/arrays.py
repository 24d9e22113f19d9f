"""Loading one episode log as numpy arrays: the reconstruction hot path.

`read_episode` (log/reader.py) returns full prompts as Python lists inside a polars frame, which is
right for people and costs O(turns^2) Python objects per episode. Reconstruction only needs numpy
views, so this module decodes the same file (same batch reader, same prefix compression) straight
into int32 arrays. A test checks that both readers agree on every prompt.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from polar_contracts.auxiliary import AuxiliaryRuleError, first_match, rules_from_metadata
from polar_contracts.episode_ids import episode_id_of, is_log_file
from polar_contracts.log.schema import KIND_CALL, KIND_END, SCHEMA
from polar_contracts.log.table import LogError, full_requests, read_table, unpack, upgrade_batch
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


@dataclass
class EpisodeHead:
    """What grouping needs, without the ids: read for every episode before building any."""
    path: Path
    episode_id: str
    finished: bool
    reward: float | None
    metadata: dict[str, Any]
    n_calls: int
    mtime: float


def list_logs(logdir: str | os.PathLike) -> list[Path]:
    d = Path(logdir)
    if not d.is_dir():
        raise LogError(f"{d}: not a directory")
    return sorted(p for p in d.iterdir() if is_log_file(p))


def _end_record(table: pa.Table, path: Path) -> tuple[bool, float | None, dict[str, Any]]:
    kinds = table.column("kind").to_pylist()
    ends = [i for i, k in enumerate(kinds) if k == KIND_END]
    if not ends:
        return False, None, {}
    last = ends[-1]
    reward = table.column("reward")[last].as_py()
    meta = table.column("metadata")[last].as_py()
    try:
        metadata = json.loads(meta) if meta else {}
    except json.JSONDecodeError as exc:
        raise LogError(f"{path}: end record metadata is not JSON ({exc})") from exc
    if not isinstance(metadata, dict):
        raise LogError(f"{path}: end record metadata is not a JSON object")
    return True, reward, metadata


def _last_batch(path: Path) -> tuple[pa.RecordBatch | None, int]:
    """The last complete record batch of the (possibly concatenated, possibly torn) streams and
    the number of batches, decoding message headers only: the end record is the last row, and
    grouping must not pay for decompressing every prompt."""
    data = pa.memory_map(str(path), "r").read_buffer() if path.stat().st_size else pa.py_buffer(b"")
    pos, count, last, last_schema, schema = 0, 0, None, SCHEMA, SCHEMA
    while pos < data.size:
        src = pa.BufferReader(data.slice(pos))
        try:
            reader = pa.ipc.MessageReader.open_stream(src)
            first = reader.read_next_message()
        except StopIteration:
            break
        except (pa.ArrowInvalid, OSError) as exc:
            if pos == 0:
                raise LogError(f"{path}: not an Arrow IPC stream ({exc})") from exc
            break  # torn tail
        if first.type != "schema":
            raise LogError(f"{path}: stream at byte {pos} does not start with a schema")
        schema = pa.ipc.read_schema(first)  # v2 streams (older proxies) have fewer columns
        while True:
            try:
                msg = reader.read_next_message()
            except (StopIteration, pa.ArrowInvalid, OSError):
                break
            if msg.type == "record batch":
                count += 1
                last, last_schema = msg, schema
        end = pos + src.tell()
        if end <= pos:
            break
        pos = end
    if last is None:
        return None, 0
    try:
        batch = pa.ipc.read_record_batch(last, last_schema)
        return (batch if last_schema.names == SCHEMA.names else upgrade_batch(batch)), count
    except (pa.ArrowInvalid, OSError) as exc:
        raise LogError(f"{path}: last record batch unreadable ({exc})") from exc


def read_head(path: str | os.PathLike) -> EpisodeHead:
    path = Path(path)
    try:
        batch, count = _last_batch(path)
        table = pa.Table.from_batches([batch]) if batch is not None else SCHEMA.empty_table()
        finished, reward, metadata = _end_record(table, path)
    except LogError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise LogError(f"{path}: cannot read ({exc})") from exc
    return EpisodeHead(path, episode_id_of(path), finished, reward, metadata, count - int(finished),
                       path.stat().st_mtime)


_EMPTY = np.zeros(0, dtype=np.int32)


def _list_column(col: pa.ChunkedArray, dtype) -> list[np.ndarray | None]:
    """A list<...> column as one numpy view per row (None for null rows), without Python lists."""
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if len(arr) == 0:
        return []
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i]:offsets[i + 1]] if valid[i] else None for i in range(len(arr))]


def _prompt_tails(calls_t: pa.Table) -> list[np.ndarray | None]:
    """The stored prompt tails as int32 arrays, whichever layout the log schema uses: a list
    column, or packed (length + zstd frame, decoded by log/table.py unpack) little-endian int32."""
    names = calls_t.schema.names
    if "prompt_tail_ids" in names:
        return _list_column(calls_t.column("prompt_tail_ids"), np.int32)
    if "prompt_tail_zstd" in names:
        return [None if b is None else np.frombuffer(unpack(b), dtype="<i4").astype(np.int32, copy=False)
                for b in calls_t.column("prompt_tail_zstd").to_pylist()]
    raise LogError(f"log schema has no prompt tail column (columns: {names})")


def read_calls(path: str | os.PathLike, *, with_requests: bool = False) -> Episode:
    """The whole episode with full prompts as int32 arrays. Raises LogError naming the file."""
    path = Path(path)
    try:
        return _read_calls(path, with_requests)
    except LogError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError) as exc:
        raise LogError(f"{path}: cannot read ({exc})") from exc


def _read_calls(path: Path, with_requests: bool) -> Episode:
    table, torn = read_table(path)
    finished, reward, metadata = _end_record(table, path)
    try:
        # the recipe's own description of its auxiliary calls, sent by the rollout node (auxiliary.py)
        aux_rules = rules_from_metadata(metadata, str(path))
    except AuxiliaryRuleError as exc:
        raise LogError(str(exc)) from exc
    # (to_pylist: to_numpy on a string column imports pandas, ~0.6 s)
    is_call = np.asarray([k == KIND_CALL for k in table.column("kind").to_pylist()], dtype=bool)
    n_calls = int(is_call.sum())
    if is_call[:n_calls].all():  # the usual layout: calls, then the end record: a zero-copy slice
        calls_t = table.slice(0, n_calls)
    else:
        calls_t = table.filter(pa.array(is_call))
    bases = calls_t.column("prompt_base_row").to_numpy(zero_copy_only=False)
    lens = calls_t.column("prompt_base_len").to_numpy(zero_copy_only=False)
    tails = _prompt_tails(calls_t)
    comps = _list_column(calls_t.column("completion_ids"), np.int32)
    lps = _list_column(calls_t.column("completion_logprobs"), np.float32)
    scalars = {c: calls_t.column(c).to_pylist() for c in _SCALARS}
    # request text is delta-coded on disk: rebuilt for every row, parsed only where needed
    all_requests = full_requests(calls_t)
    requests = all_requests if with_requests else []
    seqs: list[np.ndarray | None] = []  # per row: prompt + completion in one buffer
    calls: list[Call] = []
    for i in range(calls_t.num_rows):
        tail, comp = tails[i], comps[i]
        prompt = completion = seq = None
        base, n = -1, 0
        if tail is not None:
            base = bases[i]
            base = -1 if base is None or np.isnan(base) else int(base)
            n = 0 if lens[i] is None or np.isnan(lens[i]) else int(lens[i])
            head = _EMPTY
            if base >= 0:
                if base >= i or seqs[base] is None or n > len(seqs[base]):
                    raise LogError(f"{path}: row {i} references prompt base row {base} that cannot be used")
                head = seqs[base][:n]
            # one copy per call: the prompt and completion are views into it
            seq = np.concatenate([head, tail, comp if comp is not None else _EMPTY])
            prompt = seq[: len(head) + len(tail)]
            completion = None if comp is None else seq[len(prompt):]
        seqs.append(seq)
        info = {c: scalars[c][i] for c in _SCALARS}
        if aux_rules and not info["auxiliary"]:
            rule = first_match(aux_rules, info["api"], all_requests[i])
            if rule is not None:
                info["auxiliary"], info["auxiliary_rule"] = True, rule
        if all_requests[i] is not None and any(info[k] is None for k in PARAMS):
            # a v2 log (no sampling columns) or an unknown default: what the request set itself
            # is what the server applied (the rest stays unknown)
            for k, v in request_params(all_requests[i]).items():
                if info[k] is None:
                    info[k] = v
        lp = lps[i]
        if comp is not None and lp is not None and len(lp) != len(comp):
            info["error"] = info.get("error") or f"{len(lp)} logprobs for {len(comp)} completion ids"
        index = int(info["call_index"]) if info["call_index"] is not None else i
        calls.append(Call(i, index, prompt, completion, lp, info, seq,
                          base if prompt is not None else -1, n if prompt is not None else 0))
    calls.sort(key=lambda c: (c.call_index, c.info.get("choice") or 0))
    return Episode(path, episode_id_of(path), calls, finished, reward, metadata, torn, requests)


