"""What the runtimes share about limits (the values: recipes/limits.py): the hit, the disk watchdog's
measure."""
from __future__ import annotations

import os
from pathlib import Path

from harness_recipes.recipes.limits import human


class LimitHit(RuntimeError):
    """A sandbox reached one of its limits; ``reason`` says which and how far it went."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def disk_usage(paths: list[Path], cap: int) -> int:
    """Bytes allocated under ``paths`` (files' blocks, as du counts, hard links once), counting stops
    once past ``cap``: the watchdog only needs to know it is over. Symlinks are not followed."""
    total = 0
    seen: set[tuple[int, int]] = set()
    stack = [str(p) for p in paths]
    while stack:
        top = stack.pop()
        try:
            it = os.scandir(top)
        except OSError:  # gone, or not a directory
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                if cap and total > cap:
                    return total
    return total


def disk_reason(used: int, limit: int, what: str) -> str:
    return f"disk limit {human(limit)} reached: {human(used)} written to {what}"
