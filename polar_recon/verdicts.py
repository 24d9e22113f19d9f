"""How episodes were graded, per policy version: the manifest's ``verdicts`` and ``verdict_counts``.

A policy that learns to tamper with its grading, or to make its grading fail, shows first as a
rising share of ``tampered`` verdicts, eval errors or discards among the episodes a weight version
played. The rollout node's end metadata says each episode's verdict (``eval.verdict``,
``eval.tampered``: harness_recipes/verdict/) and whether it was discarded (``discard``, ``status``);
reconstruction records one entry per finished episode, built or discarded, with its policy version
(the oldest weight version of its calls, strategies.oldest_version), and counts them per version.
"""
from __future__ import annotations

import os
from typing import Any

from polar_contracts.log.schema import KIND_CALL
from polar_contracts.log.table import read_table
from polar_contracts.verdicts import TAMPERED_KEY, TIMED_OUT, UNCHECKED, UNREADABLE, VERDICT_KEY
from polar_recon.strategies import oldest_version

UNKNOWN = "unknown"
COUNTED = ("discarded", "eval_error", TAMPERED_KEY, UNREADABLE, TIMED_OUT, UNCHECKED)


def entry(metadata: dict[str, Any], policy: str | None) -> dict[str, Any]:
    """One episode's manifest entry from its end metadata."""
    ev = metadata.get("eval") if isinstance(metadata.get("eval"), dict) else {}
    return {"policy": policy if policy is not None else UNKNOWN, "verdict": ev.get(VERDICT_KEY),
            "tampered": ev.get(TAMPERED_KEY) is True, "discarded": metadata.get("discard") is True,
            "status": metadata.get("status")}


def log_policy(path: str | os.PathLike) -> str | None:
    """The policy version of an episode that is not built (its log's call rows, read for two columns)."""
    try:
        table, _ = read_table(path, columns=["kind", "weight_version"])
    except Exception:  # noqa: BLE001 - a log that cannot be read has no version to count under
        return None
    kinds = table.column("kind").to_pylist()
    versions = [v for k, v in zip(kinds, table.column("weight_version").to_pylist()) if k == KIND_CALL]
    return oldest_version(versions) if versions else None


def counts(verdicts: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """policy version -> {episodes, discarded, eval_error, tampered, unreadable, timed_out, unchecked}
    and each as a rate of the version's finished episodes."""
    out: dict[str, dict[str, Any]] = {}
    for e in verdicts.values():
        if not isinstance(e, dict):
            continue
        c = out.setdefault(str(e.get("policy") or UNKNOWN), {"episodes": 0, **{k: 0 for k in COUNTED}})
        c["episodes"] += 1
        c["discarded"] += bool(e.get("discarded"))
        c["eval_error"] += e.get("status") == "eval_error"
        c["tampered"] += bool(e.get("tampered"))
        for k in (UNREADABLE, TIMED_OUT, UNCHECKED):
            c[k] += e.get("verdict") == k
    for c in out.values():
        c["rates"] = {k: round(c[k] / c["episodes"], 4) for k in COUNTED}
    return dict(sorted(out.items()))
