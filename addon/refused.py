"""``LOGDIR/refused.jsonl``: one line per request the proxy refused itself (a control request without
the secret, a model call without its capability, a path that is not the model API, a body over a
bound), so an operator sees what the agent tried. Never the credentials: the line is scrubbed of
every credential the proxy knows, a capability's mac is cut from the path, and secret query
parameters are scrubbed (redact.credential_values).

Bounded: an agent can send refused requests in a loop, so after ``MAX_BYTES`` the proxy writes one
last line saying so and counts the rest in memory (``dropped``).
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable

from polar_contracts.control import CAP_SEP, PREFIX
from polar_contracts.log.table import LogError
from polar_contracts.log.writer import append_line

log = logging.getLogger("polar")

REFUSED_LOG = "refused.jsonl"
MAX_BYTES = 16 * 1024 * 1024
MAX_FIELD = 500  # characters of a path or reason kept on a line
_CAP_IN_PATH = re.compile(re.escape(PREFIX) + r"([^/?#]*?)" + re.escape(CAP_SEP) + r"[^/?#]*")


def redact_path(path: str) -> str:
    """The path with a capability's mac cut out of a ``/polar/<capability>/`` prefix."""
    return _CAP_IN_PATH.sub(lambda m: f"{PREFIX}{m.group(1)}{CAP_SEP}[redacted]", path, count=1)


class RefusedLog:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self.written = 0
        self.dropped = 0
        self.count = 0

    def record(self, logdir: str | None, *, method: str, path: str, status: int, reason: str,
               episode: str | None, scrub: Callable[[str], str] | None = None) -> None:
        """Append one refusal; never raises (a refusal is answered whether or not it is logged)."""
        self.count += 1
        if not logdir:
            return
        if self.written >= self.max_bytes:
            self.dropped += 1
            return
        rec = {"time": time.time(), "episode": episode, "method": method[:16], "path": redact_path(path)[:MAX_FIELD],
               "status": status, "reason": reason[:MAX_FIELD]}
        line = json.dumps(rec, ensure_ascii=False) + "\n"
        if scrub is not None:
            line = scrub(line)
        if self.written + len(line) >= self.max_bytes:
            line = json.dumps({"time": time.time(), "note": f"{REFUSED_LOG} reached {self.max_bytes} bytes: later "
                                                           f"refusals are not logged (the proxy still refuses them)"}) + "\n"
            self.dropped += 1
            self.written = self.max_bytes
        else:
            self.written += len(line)
        try:
            append_line(os.path.join(logdir, REFUSED_LOG), line)
        except (OSError, LogError) as exc:
            log.error("polar: could not append to %s: %s", REFUSED_LOG, exc)
