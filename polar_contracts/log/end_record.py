"""The episode's end record: the one definition of its metadata keys, their parser and its rules.

The end record is a log's last row (``kind == "end"``, schema.py): the reward and a JSON object of
metadata. The rollout node writes the metadata (harness_recipes/node/scheduler.py ``_metadata``),
the proxy's writer adds to it (``discard`` and ``polar_incomplete`` when the log lost a row), and
reconstruction, the reports and the trainer's tools read it. Every one of them names the keys by
the constants below and applies the rules (`is_discarded`, `group_of`) from here, so a key or a rule
is spelled once.

`read_head` is the cheap reader: it decodes the last record batch only (message headers for the
rest), so grouping every log, or polling one until it ends, never decompresses a prompt.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from polar_contracts.episode_ids import episode_id_of
from polar_contracts.log.schema import KIND_END, SCHEMA
from polar_contracts.log.table import LogError, upgrade_batch

# The metadata keys (the rollout node's, unless said otherwise). Types are what the writers write;
# readers apply the rules below rather than trusting a type (a user's own end record may differ).
TASK_ID = "task_id"  # str: the task the episode ran
SAMPLE = "sample"  # int: which sample of the task
GROUP_ID = "group_id"  # str: the GRPO group (the task); absent: the episode is its own group
HARNESS = "harness"  # str: the recipe's name
STATUS = "status"  # str: the node's status (ok, error, eval_error, interrupted, ...)
DISCARD = "discard"  # bool: true: no training signal, never built (see is_discarded)
REASON = "reason"  # str: why the episode failed (the node's error, cut to 500 chars)
EVAL = "eval"  # object: how it was graded, what the evaluation found; copied into the shards' "eval"
ISOLATION = "isolation"  # str: how the harness was confined (bubblewrap | docker | none)
CONTROL_PLANE = "control_plane"  # str: whether the proxy's control plane was secured (secured | open)
AUXILIARY_RULES = "auxiliary_rules"  # list of {"name", "match"}: the recipe's auxiliary calls (auxiliary.py)
TIMEOUT = "timeout"  # bool: the episode was ended on a timeout (also STATUS "timeout")
POLAR_INCOMPLETE = "polar_incomplete"  # list of str: the proxy's writer: what the log lost (then discard)

KEY_TYPES: dict[str, type | tuple[type, ...]] = {
    TASK_ID: str, SAMPLE: int, GROUP_ID: str, HARNESS: str, STATUS: str, DISCARD: bool, REASON: str,
    EVAL: dict, ISOLATION: str, TIMEOUT: bool, CONTROL_PLANE: str, AUXILIARY_RULES: list, POLAR_INCOMPLETE: list,
}


class EndRecordError(LogError):
    """An end record whose metadata is not a JSON object; the message names the file."""


def parse_metadata(text: str | None, where: str | os.PathLike) -> dict[str, Any]:
    """The end record's metadata column as a dict ({} when empty). Refuses anything that is not
    a JSON object, naming ``where`` (the log file)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, TypeError) as exc:
        raise EndRecordError(f"{where}: end record metadata is not JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise EndRecordError(f"{where}: end record metadata is not a JSON object "
                             f"(got {type(value).__name__}: {text[:100]!r})")
    return value


def is_discarded(metadata: dict[str, Any]) -> bool:
    """The discard rule: only ``"discard": true`` discards (a missing key, false, or any other
    value keeps the episode)."""
    return metadata.get(DISCARD) is True


class GroupKeyError(KeyError):
    """--group-by names a metadata key the end record lacks."""

    def __str__(self) -> str:
        return str(self.args[0])


def group_of(metadata: dict[str, Any], episode_id: str, group_by: str | None = None) -> str:
    """The episode's group: the metadata key ``group_by`` (required when given), else
    ``group_id`` when present, else the episode itself."""
    if group_by is None:
        g = metadata.get(GROUP_ID)
        return episode_id if g is None else str(g)
    if group_by == "episode":
        return episode_id
    if group_by not in metadata:
        raise GroupKeyError(f"episode {episode_id}: metadata has no {group_by!r} to group by "
                            f"(keys: {sorted(metadata)})")
    return str(metadata[group_by])


@dataclass
class EndRecord:
    finished: bool  # an end record is on disk
    reward: float | None
    metadata: dict[str, Any]


NO_END = EndRecord(False, None, {})


def end_record_of(table: pa.Table | pa.RecordBatch, where: str | os.PathLike) -> EndRecord:
    """The last end row of a table in the on-disk SCHEMA (NO_END when there is none)."""
    kinds = table.column("kind").to_pylist()
    ends = [i for i, k in enumerate(kinds) if k == KIND_END]
    if not ends:
        return NO_END
    last = ends[-1]
    reward = table.column("reward")[last].as_py()
    return EndRecord(True, reward, parse_metadata(table.column("metadata")[last].as_py(), where))


@dataclass
class EpisodeHead:
    """What grouping needs, without the ids: read for every episode before building any."""
    path: Path
    episode_id: str
    finished: bool
    reward: float | None
    metadata: dict[str, Any]
    n_calls: int  # rows before the end record (call rows and incomplete rows: one batch each)
    mtime: float


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
    """Whether the log has ended and what its end record says, from the last batch alone.
    Raises LogError naming the file (no such file, not a log, metadata not a JSON object)."""
    path = Path(path)
    if not path.exists():
        raise LogError(f"{path}: no such log")
    try:
        batch, count = _last_batch(path)
        end = end_record_of(batch, path) if batch is not None else NO_END
    except LogError:
        raise
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise LogError(f"{path}: cannot read ({exc})") from exc
    return EpisodeHead(path, episode_id_of(path), end.finished, end.reward, end.metadata, count - int(end.finished),
                       path.stat().st_mtime)
