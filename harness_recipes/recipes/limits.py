"""Per-episode resource limits: what one sandbox may use (memory, processes, CPU share, disk).

One value set, the same on every runtime: the local runtime enforces it with a cgroup per episode
(runtimes/cgroups.py) and a disk watchdog, the docker runtime with docker's own flags
(runtimes/docker.py). Defaults here; a recipe may change them in its ``[limits]`` table (a harness
that needs more memory), the command line (--memory, --pids, --cpus, --disk) overrides both. 0 means
no limit for that resource. Defined here, below the runtimes, so that a recipe is checked on load.

An episode that reaches a limit is stopped and ends with status ``resource_limit`` and the reason
(runtimes/limits.py: LimitHit); nothing else on the node is touched.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
         "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
LIMIT_KEYS = ("memory", "pids", "cpus", "disk")


def parse_size(value: str | int, what: str) -> int:
    """'256m', '4g', '64MiB', 1048576 -> bytes (binary units, as docker's); 0 or 'none': no limit."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a size such as 256m or 4g, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what} must be a size >= 0, not {value}")
        return value
    if str(value).strip().lower() in ("none", "unlimited"):
        return 0
    m = SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"{what} must be a size such as 256m, 4g or 0 (no limit), not {value!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Limits:
    """One episode's sandbox limits; 0: no limit. cpus is a share of CPU time (2.0: two cores' worth)."""

    memory: int = 4 << 30  # bytes, RAM (no swap beyond it); tmpfs pages the agent writes count too
    pids: int = 1024  # processes and threads at once
    cpus: float = 2.0
    disk: int = 8 << 30  # bytes the agent may write: workspace, home, /tmp, the container's writable layer
    # how often the disk watchdog measures the writable paths (seconds)
    disk_poll: float = 2.0

    def __post_init__(self):
        if self.memory and self.memory < 16 << 20:
            raise ValueError(f"memory limit {human(self.memory)} is below 16 MiB: no harness starts in that")
        if self.pids < 0 or self.cpus < 0 or self.disk < 0:
            raise ValueError(f"limits must be >= 0 (0: none): {self}")
        if self.pids and self.pids < 8:
            raise ValueError(f"pids limit {self.pids} is below 8: the sandbox's own init and shell need some")

    def describe(self) -> str:
        def v(x, f):
            return f(x) if x else "none"
        return (f"memory {v(self.memory, human)}, pids {v(self.pids, str)}, cpus {v(self.cpus, str)}, "
                f"disk {v(self.disk, human)}")

    def merged(self, overrides: dict) -> Limits:
        """These limits with ``overrides`` (a recipe's [limits] table, command-line options) applied;
        None values are left out, unknown keys are an error."""
        unknown = sorted(set(overrides) - set(LIMIT_KEYS))
        if unknown:
            raise ValueError(f"unknown limit(s) {', '.join(unknown)} (allowed: {', '.join(LIMIT_KEYS)})")
        return replace(self, **parse_limits({k: v for k, v in overrides.items() if v is not None}))


def parse_limits(raw: dict, where: str = "limits") -> dict:
    """A [limits] table or option values -> Limits field values, each checked."""
    out: dict = {}
    for key, value in raw.items():
        if key in ("memory", "disk"):
            out[key] = parse_size(value, f"{where}.{key}")
        elif key == "pids":
            if isinstance(value, bool) or not isinstance(value, int) and not str(value).isdigit():
                raise ValueError(f"{where}.pids must be a whole number (0: no limit), not {value!r}")
            out[key] = int(value)
        elif key == "cpus":
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{where}.cpus must be a number of cores (0: no limit), not {value!r}") from None
            if isinstance(value, bool) or out[key] < 0:
                raise ValueError(f"{where}.cpus must be a number of cores >= 0, not {value!r}")
        else:
            raise ValueError(f"{where}: unknown limit {key!r} (allowed: {', '.join(LIMIT_KEYS)})")
    return out
