"""What `polar-recon compare` reads: each INPUT resolved to one or more harness sources.

An INPUT is one of
- a fleet store (``shards/``, ``logs/``, ``rollout/records/``: harness_recipes/fleet/store.py) or the
  demo's output (``shards/``, ``logs/``, ``rollout/episodes.jsonl``);
- a ``polar-rollout run --out`` directory (``shard-*.parquet``, ``rollout/episodes.jsonl`` and the run's
  own logs in ``rollout/logs/``);
- an experiment's store root, ``<store>/<recipe>/`` one store per harness (fleet/experiment.py);
- a log directory (``*.arrow`` only): its episodes are grouped by their end metadata's harness.
``NAME=PATH`` names the harness of PATH (default: the records' harness, else the directory name).
Logs a source does not hold itself (a shared proxy logdir) are looked up in ``--logdir`` by episode id.
"""
from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from polar_contracts.shards import MANIFEST, SHARD_GLOB


class SourceError(ValueError):
    """An INPUT that is none of the shapes above; the message names it and what was looked for."""


@dataclass
class Source:
    label: str | None  # the harness; None: from the records / log metadata
    root: Path
    shards: list[Path] = field(default_factory=list)
    manifest: Path | None = None
    records: list[Path] = field(default_factory=list)  # episodes.jsonl files and per-episode record JSONs
    logdirs: list[Path] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.label or self.root.name


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob(SHARD_GLOB)) if d.is_dir() else []


def _store_like(p: Path) -> bool:
    return bool(_shards(p)) or (p / "shards").is_dir() or (p / "rollout").is_dir()


def _one(p: Path, label: str | None) -> Source:
    shard_dir = p / "shards" if (p / "shards").is_dir() else p
    records = []
    if (p / "rollout" / "episodes.jsonl").is_file():
        records.append(p / "rollout" / "episodes.jsonl")
    rec_dir = p / "rollout" / "records"
    if rec_dir.is_dir():
        records += sorted(rec_dir.glob("*.json"))
    manifest = shard_dir / MANIFEST
    # logs/: a store's or the demo's; rollout/logs/: a `polar-rollout run` OUT's own episodes' logs
    logdirs = [d for d in (p / "logs", p / "rollout" / "logs") if d.is_dir()]
    return Source(label=label, root=p, shards=_shards(shard_dir), manifest=manifest if manifest.is_file() else None,
                  records=records, logdirs=logdirs)


def resolve(inputs: list[str], logdirs: list[str | os.PathLike] = ()) -> list[Source]:
    """The sources of INPUT... (each ``PATH`` or ``NAME=PATH``); raises SourceError naming a bad one."""
    out: list[Source] = []
    extra = [Path(d) for d in logdirs]
    for d in extra:
        if not d.is_dir():
            raise SourceError(f"--logdir {d}: not a directory")
    for spec in inputs:
        label, _, path = spec.rpartition("=") if "=" in spec and not Path(spec).exists() else (None, "", spec)
        u = urllib.parse.urlsplit(path)
        if u.scheme == "file":  # a fleet's --store URI on this machine
            path = urllib.parse.unquote(u.path)
        elif u.scheme and "://" in path:
            raise SourceError(f"{spec}: only local stores are read ({u.scheme}:// is not; mount or copy the store "
                              f"and pass its path)")
        p = Path(path)
        if not p.is_dir():
            raise SourceError(f"{spec}: not a directory")
        if _store_like(p):
            found = [_one(p, label or None)]
        elif any(p.glob("*.arrow")):
            found = [Source(label=label or None, root=p, logdirs=[p])]
        else:
            subs = sorted(s for s in p.iterdir() if s.is_dir() and _store_like(s))
            if not subs:
                raise SourceError(f"{spec}: not a store, rollout output, log directory or experiment root (found no "
                                  f"shards/, {SHARD_GLOB}, rollout/ or *.arrow in it or its subdirectories)")
            if label:
                raise SourceError(f"{spec}: NAME= names one harness, but {p} holds {len(subs)} "
                                  f"({', '.join(s.name for s in subs)})")
            found = [_one(s, s.name) for s in subs]
            if (p / "logs").is_dir():  # a logdir the harnesses shared (one proxy for all), beside them
                for s in found:
                    s.logdirs.append(p / "logs")
        for s in found:
            s.logdirs += [d for d in extra if d not in s.logdirs]
        out += found
    return out
