"""The episode log schema: the one definition shared by the addon's writer and every reader.

One file per episode, ``LOGDIR/<episode_id>.arrow``, in the Arrow IPC *stream* format, one record
batch per row, flushed per row, so a reader (or a proxy killed with SIGKILL) never sees more than
one torn batch at the end, and every batch before it is readable.

Rows are of two kinds:
- ``kind == "call"``: one model call (one choice of it when the harness asked for ``n > 1``).
- ``kind == "incomplete"``: the log lost a call (see KIND_INCOMPLETE); ``error`` says what.
- ``kind == "end"``: the episode's end record (reward + metadata), always the last row. A file
  whose last row is an end record is a finished episode; anything else is still running (or was
  cut off).

Prompts are stored compressed against an earlier row of the same episode: ``prompt_base_row``
names the earlier call row by its position among the file's call rows (-1: none),
``prompt_base_len`` how many leading tokens of that row's prompt+completion sequence this prompt
shares, and ``prompt_tail_zstd`` the rest. Storing every
full prompt would be O(N^2) in the number of turns. ``read_log`` always returns full prompt_ids.
The request text is stored the same way (against the previous call row). The three big payloads
(prompt tail, request delta, response) are "packed": 4 bytes little-endian raw length, then one
zstd frame. (Arrow IPC body compression was tried: it compresses all ~70 small buffers of a row
with a fresh context each, ~1.5 ms CPU a row, more than the whole per-call budget of the proxy.)
So a growing episode costs about its new tokens.

Schema v3 added the sampling columns (``sampling_fields.COLUMNS``: what the server applied and what its
logprobs are; rules in polar_contracts/sampling_fields.py). A v2 log (or a v2 stream followed by a v3 one, after a proxy
upgrade and restart) reads with those columns null: unknown, which is what they are.
Schema v4 added ``sampling_source`` (where the sampling values come from); a v3 stream reads with it null.
"""
from __future__ import annotations

import pyarrow as pa

from polar_contracts.sampling_fields import COLUMNS as SAMPLING_COLUMNS
from polar_contracts.sampling_fields import SAMPLING_FIELDS

SCHEMA_VERSION = 4

KIND_CALL = "call"
KIND_END = "end"
# A row the proxy writes when the log lost something (a call whose row could not be written, a log
# file deleted under it): readers of calls skip it; an episode with one is never built (the end
# record then carries "discard": true and the reasons under "polar_incomplete").
KIND_INCOMPLETE = "incomplete"


# Columns in file order. Nullable everywhere: a call that failed has no ids, an end row no api.
FIELDS: list[pa.Field] = [
    pa.field("kind", pa.string()),
    pa.field("episode_id", pa.string()),
    pa.field("call_index", pa.int32()),
    pa.field("choice", pa.int32()),
    pa.field("api", pa.string()),  # chat | completions | responses | messages
    pa.field("dialect", pa.string()),  # vllm | sglang
    pa.field("model", pa.string()),
    pa.field("status", pa.int32()),  # upstream HTTP status (null: no response at all)
    pa.field("error", pa.string()),  # null when the call is complete and has its ids
    pa.field("stream", pa.bool_()),
    pa.field("t_start", pa.float64()),  # unix seconds: request received from the harness
    pa.field("t_first_byte", pa.float64()),  # first response byte from upstream
    pa.field("t_end", pa.float64()),  # response finished (or failed)
    # read_log's `request`: JSON as the harness sent it, secrets redacted. On disk (packed, see
    # below): only the part that differs from the previous call row's request (file order); the
    # first request_prefix_len and last request_suffix_len UTF-8 bytes are that earlier request's.
    pa.field("request_zstd", pa.binary()),
    pa.field("request_prefix_len", pa.int32()),
    pa.field("request_suffix_len", pa.int32()),
    # read_log's `response`: JSON as the harness received it (streams reassembled); packed UTF-8.
    pa.field("response_zstd", pa.binary()),
    pa.field("prompt_base_row", pa.int32()),
    pa.field("prompt_base_len", pa.int32()),
    pa.field("prompt_tail_zstd", pa.binary()),  # packed int32 little-endian ids
    pa.field("completion_ids", pa.list_(pa.int32())),
    pa.field("completion_logprobs", pa.list_(pa.float32())),
    pa.field("finish_reason", pa.string()),
    # the policy version that served the call (the proxy mediates weight syncs: addon/weight_hold.py);
    # 'spans:["A","B"]' (in flight across a sync) and 'unknown:<why>' name no single version
    # (polar_contracts/weight_versions.py): the trainer never reads them as one
    pa.field("weight_version", pa.string()),
    *SAMPLING_FIELDS,
    pa.field("auxiliary", pa.bool_()),  # e.g. Claude Code's title call: recorded, not trained
    pa.field("notes", pa.list_(pa.string())),  # normalizations applied, fields dropped, warnings
    pa.field("reward", pa.float64()),  # end rows only
    pa.field("metadata", pa.string()),  # end rows only: JSON
]

SCHEMA = pa.schema(FIELDS, metadata={b"polar.log.schema_version": str(SCHEMA_VERSION).encode()})
COLUMNS = [f.name for f in FIELDS]

# The sampling columns were added in schema v3. Older logs (v2: every other column) stay readable:
# log/table.py reads their batches with these columns null (unknown), which is what they are.
V2_COLUMNS = [c for c in COLUMNS if c not in SAMPLING_COLUMNS]
V3_COLUMNS = [c for c in COLUMNS if c != "sampling_source"]
# Older streams a reader accepts (log/table.py upgrade_batch: the columns they lack read null).
OLDER_COLUMNS = (V2_COLUMNS, V3_COLUMNS)

# The on-disk columns read_log replaces with `request`, `response` and full `prompt_ids`.
READ_DROP = ("prompt_base_row", "prompt_base_len", "prompt_tail_zstd", "request_zstd", "request_prefix_len",
             "request_suffix_len", "response_zstd")
