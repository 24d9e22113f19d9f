"""How each inference server reports its weight version and loads new weights from disk (sans-IO:
the requests to send and how to read the answers; addon/weight_hold.py sends them).

- ``vllm`` (real vLLM 0.32, started with ``VLLM_SERVER_DEV_MODE=1``, which registers the RL and
  dev routes: vllm/entrypoints/launchers/api_server/routers.py): ``GET /weight_info`` ->
  ``{"weight_version": "default"}``; a sync is ``POST /pause?mode=wait`` (drained: the engine
  clears its KV and prefix caches) or ``?mode=keep`` (calls still in flight freeze and continue
  on the new weights; then ``POST /reset_prefix_cache?reset_running_requests=true``), ``POST
  /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (the in-place
  reload of v1/worker/gpu_model_runner.py ``reload_weights``, which the CPU worker inherits: the
  only full-weight path that runs on the CPU build; the weight-transfer endpoints need NCCL or
  CUDA IPC), ``POST /update_weight_version {"new_version": V}``, and ``POST /resume`` always,
  failure or not (entrypoints/rl/online/api_router.py). The reload is in place: a failure midway
  may leave mixed weights (``atomic`` False).
- ``sglang`` (SGLang 0.5.23, entrypoints/http_server.py): ``GET /model_info`` ->
  ``{"weight_version": ...}``; ``POST /update_weights_from_disk {"model_path": DIR,
  "weight_version": V}`` -> 200 ``{"success": true, "message", "num_paused_requests"}`` or 400
  with ``"success": false``. SGLang waits for running requests itself (its model_update_lock) and
  rolls back to the old weights when a load fails (model_runner_components/weight_updater.py).
- ``polar-serve`` (its vllm dialect; its sglang dialect speaks SGLang's routes): ``GET
  /polar/weight_version``; ``POST /polar/reload {"model": DIR, "weight_version": V}``; it loads
  the new model before swapping it in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from polar_contracts.control import SERVE_RELOAD_PATH, SERVE_VERSION_PATH

KINDS = ("vllm", "sglang", "polar-serve")
VERSION_PATH = {"vllm": "/weight_info", "sglang": "/model_info", "polar-serve": SERVE_VERSION_PATH}
# auto: the first of these the server answers names its kind (vLLM's route only exists in dev mode)
PROBE_ORDER = KINDS
ATOMIC = {"vllm": False, "sglang": True, "polar-serve": True}


class ServerAnswerError(ValueError):
    """An answer that is not what the server's API promises; the message quotes it."""


@dataclass(frozen=True)
class Step:
    what: str  # a short name for logs and the sync record
    method: str
    path: str
    body: dict | None = None
    always: bool = False  # sent even after an earlier step failed (vLLM's /resume)
    loads: bool = False  # the step that changes the weights


def parse_version_answer(kind: str, status: int, body: bytes) -> str:
    """The version in a version endpoint's answer; ServerAnswerError when there is none."""
    if status != 200:
        raise ServerAnswerError(f"GET {VERSION_PATH[kind]} answered HTTP {status}: {_short(body)}")
    obj = _json(body)
    v = obj.get("weight_version") if isinstance(obj, dict) else None
    if not isinstance(v, str | int) or isinstance(v, bool):
        raise ServerAnswerError(f"GET {VERSION_PATH[kind]} has no weight_version: {_short(body)}")
    return str(v)


def sync_steps(kind: str, path: str, version: str, drained: bool) -> list[Step]:
    """The requests that make ``kind`` serve the weights in ``path`` as ``version``."""
    if kind == "vllm":
        steps = [Step("pause", "POST", "/pause?mode=" + ("wait" if drained else "keep")),
                 Step("reload_weights", "POST", "/collective_rpc",
                      {"method": "reload_weights", "kwargs": {"weights_path": path}}, loads=True)]
        if not drained:  # keep mode does not clear the caches: blocks computed by the old weights
            steps.append(Step("reset_prefix_cache", "POST", "/reset_prefix_cache?reset_running_requests=true"))
        return [*steps, Step("update_weight_version", "POST", "/update_weight_version", {"new_version": version}),
                Step("resume", "POST", "/resume", always=True)]
    if kind == "sglang":
        return [Step("update_weights_from_disk", "POST", "/update_weights_from_disk",
                     {"model_path": path, "weight_version": version}, loads=True)]
    if kind == "polar-serve":
        return [Step("reload", "POST", SERVE_RELOAD_PATH, {"model": path, "weight_version": version}, loads=True)]
    raise ValueError(f"unknown server kind {kind!r}; one of {KINDS}")


def check_step(kind: str, step: Step, status: int, body: bytes) -> str | None:
    """None when the step did what it should, else the reason (quoting the server)."""
    if status != 200:
        return f"{step.method} {step.path} answered HTTP {status}: {_short(body)}"
    obj = _json_or_none(body)
    if kind == "sglang" and step.what == "update_weights_from_disk":
        if not isinstance(obj, dict) or obj.get("success") is not True:
            return f"update_weights_from_disk did not succeed: {_short(body)}"
    if step.what == "reset_prefix_cache" and not (isinstance(obj, dict) and obj.get("success") is True):
        return f"reset_prefix_cache failed (blocks still held): {_short(body)}"
    if kind == "polar-serve" and not (isinstance(obj, dict) and obj.get("weight_version") is not None):
        return f"/polar/reload answered without weight_version: {_short(body)}"
    return None


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise ServerAnswerError(f"not JSON: {_short(body)}") from None


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None


def _short(body: bytes, n: int = 300) -> str:
    return body[:n].decode("utf-8", "replace")
