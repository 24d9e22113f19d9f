"""What the inference server said, seen from the node: before any episode, and in an episode's log.

A recipe whose model name the server does not serve (the harness asks for ``--model``, the server
serves another) would otherwise end every episode ``done`` with reward 0, the cause only in the
harness's own output. So ``polar-rollout run`` asks the server's model list through the proxy
first (``served_models``, ``model_mismatch``: ``GET /v1/models`` is forwarded, never captured), and
after each harness run reads the episode's capture log (``upstream_failure``): when every model call
the harness made was answered with an error status, the episode is an infrastructure error carrying
the server's message, ended at the proxy as discarded, and run again on restart.
"""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Sequence

from polar_contracts.control import EPISODE_HEADER, capability

# The id the node names its own model-list request by (a secured proxy forwards nothing without an
# episode's capability); GET /v1/models opens no log for it.
PREFLIGHT_EPISODE = "polar-rollout-preflight"


def served_models(proxy: str, secret: str | None, timeout: float = 10.0) -> list[str] | None:
    """The model ids the server behind ``proxy`` lists, or None when they could not be read (the
    proxy or server down, a server without the list): the caller then only warns."""
    headers = {EPISODE_HEADER: capability(secret, PREFLIGHT_EPISODE)} if secret else {}
    req = urllib.request.Request(proxy.rstrip("/") + "/v1/models", headers=headers)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (never via an http_proxy)
    try:
        with opener.open(req, timeout=timeout) as r:
            body = json.loads(r.read(1 << 20))
        return [str(m["id"]) for m in body["data"]]
    except (OSError, ValueError, KeyError, TypeError):  # (HTTPError and URLError are OSErrors)
        return None


def model_mismatch(model: str, served: Sequence[str]) -> str:
    """'' when ``model`` is served, else the error that says what to pass instead."""
    if model in served:
        return ""
    names = ", ".join(served) or "no model"
    return (f"--model {model}: the server behind the proxy serves {names} (GET /v1/models), so every model "
            f"call of the harness would fail with 404. Pass --model {served[0] if served else 'NAME'} (the name "
            f"the harness asks for), or start the server with that name (vLLM: --served-model-name {model}).")


def error_message(status: int | None, response: str | None, error: str | None) -> str:
    """One failed call in a line: its HTTP status and the server's own message when it gave one."""
    msg = ""
    try:
        body = json.loads(response or "")
        err = body.get("error", body) if isinstance(body, dict) else {}
        msg = err.get("message", "") if isinstance(err, dict) else str(err)
    except ValueError:
        msg = (response or "").strip()
    msg = str(msg or error or "no answer").strip()[:300]
    return f"HTTP {status} {msg}" if status is not None else msg


def upstream_failure(calls) -> str:
    """'' unless the episode made model calls and none was answered with a 2xx status; then the
    episode's error: how many calls failed and the first one's message. ``calls``: the log's call
    rows (polars, with ``status``, ``response``, ``error``)."""
    if calls.height == 0:
        return ""
    statuses = calls["status"].to_list()
    if any(s is not None and 200 <= s < 300 for s in statuses):
        return ""
    first = calls.row(0, named=True)
    return (f"every model call failed upstream ({calls.height} of {calls.height}): "
            f"{error_message(first['status'], first.get('response'), first.get('error'))}")


def log_upstream_failure(path) -> str:
    """``upstream_failure`` of the episode log at ``path``; '' when there is no readable log (no call
    reached the proxy: the harness's own output says why). Read once per episode, after its harness."""
    from polar_contracts.log.reader import read_episode
    from polar_contracts.log.table import LogError
    try:
        return upstream_failure(read_episode(path).calls)
    except LogError:
        return ""
