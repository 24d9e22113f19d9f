"""Token-faithful reconstruction of training sequences from Polar episode logs.

``polar-recon build LOGDIR OUT`` (cli.py): read each episode log, link its calls into sequences
(strategies.py, link.py with tokens.py, rerender.py, fidelity.py), write shards (shard_writer.py);
``inspect``, ``drift``, ``stats`` (diagnostics.py), ``show`` (html.py) and ``compare`` (compare/)
report on them. The log and shard formats themselves are contracts and live in polar_contracts.

``polar_recon.read_log`` and ``polar_recon.read_episode`` are the documented way for a user to read
one episode log (a polars frame with full prompts); they are polar_contracts/log/reader.py's
functions. Code in this repository imports the log names from polar_contracts.
"""
from __future__ import annotations

import importlib

_EXPORTS = ("read_episode", "read_log")
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    # loaded on first use: importing polar_recon (or the capture-side code beside it) loads no polars
    if name in _EXPORTS:
        return getattr(importlib.import_module("polar_contracts.log.reader"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
