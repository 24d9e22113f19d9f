"""The shard contract, in one place (polar-recon writes it, the trainer and reports read it): the
columns (SHARD_SCHEMA), the file names, the termination values.

``OUT/shard-NNNNNN.parquet`` (six or more digits, numbered in landing order) is a complete shard:
it is written as ``OUT/.shard-NNNNNN.parquet.tmp`` and renamed when complete, so a reader that
lists only names matching SHARD_RE never sees a partial one. ``OUT/.polar-recon-manifest.json``
(also written to a temporary name and renamed) lists the episodes built and those excluded, with a
reason each; ``OUT/.polar-recon.lock`` keeps two builders out of one OUT.
"""
from __future__ import annotations

import re

import pyarrow as pa

from polar_contracts.sampling_fields import SAMPLING_FIELDS

SHARD_RE = re.compile(r"^shard-(\d{6,})\.parquet$")
SHARD_GLOB = "shard-*.parquet"  # for readers that glob (polars, datasets): matches only complete shards
SHARD_TEMP_GLOB = ".shard-*.parquet.tmp"
MANIFEST = ".polar-recon-manifest.json"
LOCK = ".polar-recon.lock"


def shard_name(n: int) -> str:
    return f"shard-{n:06d}.parquet"


def shard_temp_name(n: int) -> str:
    """Where shard n is written until it is complete (a hidden name SHARD_RE never matches)."""
    return f".{shard_name(n)}.tmp"


def temp_name(name: str) -> str:
    """The temporary name a file of OUT (the manifest) is written to before its rename."""
    return f"{name}.tmp"


def shard_seq(name: str) -> int | None:
    """Sequence number of a shard file name, None for anything else (temporary names included)."""
    m = SHARD_RE.match(name)
    return int(m.group(1)) if m else None


SHARD_SCHEMA = pa.schema([
    pa.field("episode_id", pa.string()),
    pa.field("group_id", pa.string()),
    pa.field("segment", pa.int32()),
    pa.field("input_ids", pa.list_(pa.int32())),
    pa.field("loss_mask", pa.list_(pa.int8())),
    pa.field("logprobs", pa.list_(pa.float32())),
    pa.field("prompt_len", pa.int32()),
    pa.field("reward", pa.float64()),
    pa.field("n_calls", pa.int32()),
    pa.field("strategy", pa.string()),
    pa.field("n_realign", pa.int32()),
    pa.field("weight_version", pa.string()),
    pa.field("model", pa.string()),
    pa.field("group_size", pa.int32()),
    pa.field("group_complete", pa.bool_()),
    # The sampling columns, as in the log (sampling_fields.SAMPLING_FIELDS: what the server applied to the
    # row's calls, null = unknown). A row whose calls differ in one gets null there and the
    # sampling_unsupported reason "mixed sampling parameters across calls" (sampling_fields.py). The
    # trainer computes its old-policy logprobs under the same transform, and excludes or refuses
    # unsupported rows.
    *SAMPLING_FIELDS,
    # Context fidelity (polar_recon/link.py, fidelity.py): tokens of this row's context that differ from the
    # prompt the server was served for a later call of the row, all of a KNOWN re-render class
    # (the row keeps the sampled tokens; the served prompt held them re-rendered), and the names
    # of those classes (link.REALIGN_CLASSES). 0 / [] = every call saw exactly its row prefix.
    pa.field("realign_tokens", pa.int32()),
    pa.field("realign_classes", pa.list_(pa.string())),
    # How the row ended: stop | length | timeout | error (TERMINATIONS), for the trainer's
    # mask_truncated_completions: the row's own last completion when it was cut (length) or failed,
    # else the episode's end (timeout from the end metadata, else its last call's finish), so every
    # row of a truncated episode says so (polar_recon/strategies.py termination). null = unknown (an older build).
    pa.field("termination", pa.string()),
    # What the rollout's evaluation found beyond the reward (the end metadata's "eval", as JSON),
    # e.g. a SWE-bench instance's resolved flag and per-test results (FAIL_TO_PASS / PASS_TO_PASS
    # success and failure lists, swebench's report). null = the rollout recorded none.
    pa.field("eval", pa.string()),
    # How the rollout confined the harness (the end metadata's "isolation"): bubblewrap | docker |
    # none (an explicit --isolation none: the agent ran unsandboxed). null = unknown (an older rollout).
    pa.field("isolation", pa.string()),
    # Whether the capture proxy's control plane was secured (the end metadata's "control_plane"):
    # secured | open (polar-rollout run --unsafe-open-proxy: the agent could have ended its own
    # episode with a reward of its choosing). null = unknown (an older rollout).
    pa.field("control_plane", pa.string()),
])

# Columns a shard of an older build may lack (readers treat them as null): the sampling columns and these.
FIDELITY_COLUMNS = ("realign_tokens", "realign_classes", "termination", "isolation", "control_plane")
# The `termination` values; TRUNCATED are those whose last completion was cut short.
TERMINATIONS = ("stop", "length", "timeout", "error")
TRUNCATED = ("length", "timeout")
# The columns a trainer cannot do without; every other column of SHARD_SCHEMA is optional to a reader.
TRAINING_COLUMNS = ("episode_id", "group_id", "segment", "input_ids", "loss_mask", "logprobs", "prompt_len", "reward")
OPTIONAL_COLUMNS = tuple(n for n in SHARD_SCHEMA.names if n not in TRAINING_COLUMNS)
