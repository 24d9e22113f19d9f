"""The capture proxy's control protocol: the paths and bodies of the requests that end an episode
and sync the weights, and their parsers. The proxy answers them (addon/polar_addon.py); the rollout
node, the fleet and the trainer send them. Defined once, here.

``POST /polar/<episode_id>/end`` ``{"reward": float, "metadata": {...}}``: the episode's end record.

``POST /polar/@weights`` ``{"path": DIR, "version": V[, "peers_drained": bool]}``: hold new calls,
drain those in flight, have the server load DIR as V, release (addon/weight_hold.py). ``@`` cannot
be in an episode id, so these paths never collide with ``/polar/<episode_id>/...``. Several proxies
in front of one server sync as one: ``POST /polar/@weights/hold`` ``{"version": V, "lease_s": S}``
to all but one, the ordinary sync to that one, then ``POST /polar/@weights/release``
``{"version": V, "weight_version": W, "ok": B}`` to the held ones.

Every parser raises ControlRequestError (answered 400, never forwarded) naming the problem.
"""
from __future__ import annotations

import json
import math

from polar_contracts.weight_versions import VERSION_RE, check_version, is_marker

EPISODE_HEADER = "x-polar-episode"
PREFIX = "/polar/"
END = "end"
SYNC_PATH = "/polar/@weights"
HOLD_PATH = SYNC_PATH + "/hold"
RELEASE_PATH = SYNC_PATH + "/release"
ENDPOINTS = (SYNC_PATH, HOLD_PATH, RELEASE_PATH)
SYNC_BODY_KEYS = frozenset({"path", "version"})
SYNC_OPTIONAL_KEYS = frozenset({"peers_drained"})
HOLD_BODY_KEYS = frozenset({"version", "lease_s"})
RELEASE_BODY_KEYS = frozenset({"version", "weight_version", "ok"})
END_BODY_KEYS = frozenset({"reward", "metadata"})
MAX_LEASE_S = 24 * 3600.0

# polar-serve's own weight endpoints (the stand-in server, not the proxy): what the trainer's
# sync_mode=polar and the proxy's polar-serve kind call.
SERVE_RELOAD_PATH = "/polar/reload"
SERVE_VERSION_PATH = "/polar/weight_version"
# The header polar-serve stamps on every answer with the version that served it (the proxy reads it).
WEIGHT_VERSION_HEADER = "x-polar-weight-version"


class ControlRequestError(ValueError):
    """A control request the proxy refuses (HTTP ``status``, 400 by default); the message names the problem."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def episode_prefix(episode_id: str) -> str:
    """The path prefix that names an episode: ``/polar/<episode_id>``."""
    return PREFIX + episode_id


def end_path(episode_id: str) -> str:
    """``/polar/<episode_id>/end``."""
    return f"{episode_prefix(episode_id)}/{END}"


def parse_end_body(body: bytes) -> tuple[float | None, dict]:
    """The body of POST /polar/<id>/end: {"reward": float, "metadata": {...}} (both optional)."""
    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number (a reward must be a finite number)")

    if not body.strip():
        return None, {}
    try:
        obj = json.loads(body, parse_constant=no_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlRequestError(f"episode end body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ControlRequestError("episode end body must be a JSON object {\"reward\": float, \"metadata\": {...}}")
    unknown = set(obj) - {"reward", "metadata"}
    if unknown:
        raise ControlRequestError(f"episode end body has unknown keys {sorted(unknown)}; allowed: reward, metadata")
    reward = obj.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise ControlRequestError(f"reward must be a number, got {type(reward).__name__}")
    meta = obj.get("metadata", {})
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise ControlRequestError(f"metadata must be a JSON object, got {type(meta).__name__}")
    if reward is not None:
        try:
            reward = float(reward)
        except OverflowError:  # a 400-digit integer
            raise ControlRequestError(f"reward is out of range for a float: {str(obj['reward'])[:40]}...") from None
        if not math.isfinite(reward):  # 1e400 reads as infinity
            raise ControlRequestError(f"reward must be a finite number, got {reward}")
    return reward, meta




def _json_object(raw: bytes, what: str, keys: frozenset, optional: frozenset = frozenset()) -> dict:
    try:
        obj = json.loads(raw or b"")
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlRequestError(f"{what} body is not valid JSON: {exc}") from None
    shape = "{" + ", ".join(f'"{k}": ...' for k in sorted(keys)) + "}"
    if not isinstance(obj, dict):
        raise ControlRequestError(f"{what} body must be a JSON object {shape}")
    extra, missing = set(obj) - keys - optional, keys - set(obj)
    if extra or missing:
        raise ControlRequestError(f"{what} body: unknown keys {sorted(extra)}, missing keys {sorted(missing)}; "
                               f"expected {shape}" + (f" (optional: {sorted(optional)})" if optional else ""))
    return obj


def _version(v: object, what: str) -> str:
    try:
        return check_version(v, what)
    except ValueError as exc:
        raise ControlRequestError(str(exc)) from None


def parse_sync_body(raw: bytes) -> tuple[str, str]:
    """(path, version) of a POST /polar/@weights body, validated strictly."""
    return parse_sync_request(raw)[:2]


def parse_sync_request(raw: bytes) -> tuple[str, str, bool]:
    """(path, version, peers_drained) of a POST /polar/@weights body; ``peers_drained`` (default
    true) is false when another proxy in front of the same server still had calls in flight."""
    obj = _json_object(raw, "weight sync", SYNC_BODY_KEYS, SYNC_OPTIONAL_KEYS)
    path = obj["path"]
    if not isinstance(path, str) or not path or "\x00" in path or len(path) > 4096:
        raise ControlRequestError(f"weight sync 'path' must be a non-empty directory path string, not {path!r}")
    peers_drained = obj.get("peers_drained", True)
    if not isinstance(peers_drained, bool):
        raise ControlRequestError(f"weight sync 'peers_drained' must be true or false, not {peers_drained!r}")
    return path, _version(obj["version"], "weight sync 'version'"), peers_drained


def parse_hold_body(raw: bytes) -> tuple[str, float]:
    """(version, lease_s) of a POST /polar/@weights/hold body."""
    obj = _json_object(raw, "weight hold", HOLD_BODY_KEYS)
    lease = obj["lease_s"]
    if isinstance(lease, bool) or not isinstance(lease, int | float) or not 0 < lease <= MAX_LEASE_S:
        raise ControlRequestError(f"weight hold 'lease_s' must be a number of seconds in (0, {MAX_LEASE_S:g}], "
                               f"not {lease!r}")
    return _version(obj["version"], "weight hold 'version'"), float(lease)


def parse_release_body(raw: bytes) -> tuple[str, str | None, bool]:
    """(version held for, weight_version after, ok) of a POST /polar/@weights/release body. The
    version after may be a marker (the sync failed and left the weights unknown) or null."""
    obj = _json_object(raw, "weight release", RELEASE_BODY_KEYS)
    after, ok = obj["weight_version"], obj["ok"]
    if not isinstance(ok, bool):
        raise ControlRequestError(f"weight release 'ok' must be true or false, not {ok!r}")
    if after is not None and not (isinstance(after, str) and 0 < len(after) <= 1024 and
                                  (is_marker(after) or VERSION_RE.match(after))):
        raise ControlRequestError(f"weight release 'weight_version' must be a version, a spans:/unknown: marker "
                               f"or null, not {after!r}")
    return _version(obj["version"], "weight release 'version'"), after, ok
