"""The shard file contract, in one place (polar-recon writes it, the trainer and reports read it).

``OUT/shard-NNNNNN.parquet`` (six or more digits, numbered in landing order) is a complete shard:
it is written as ``OUT/.shard-NNNNNN.parquet.tmp`` and renamed when complete, so a reader that
lists only names matching SHARD_RE never sees a partial one. ``OUT/.polar-recon-manifest.json``
(also written to a temporary name and renamed) lists the episodes built and those excluded, with a
reason each; ``OUT/.polar-recon.lock`` keeps two builders out of one OUT.
"""
from __future__ import annotations

import re

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
