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

Who may send them. The agent under training can reach the proxy (its model calls go through it),
so the proxy holds a control secret (``new_secret``; handed to it in a 0600 file) and:

- every control request (``/polar/<id>/end``, ``/polar/@...``) carries it in header
  ``x-polar-control`` (``CONTROL_HEADER``), compared in constant time (``check_secret``);
- every model call names its episode by a capability, ``<episode_id>~<mac>`` with mac =
  HMAC-SHA256(secret, episode_id) truncated to 128 bits, base64url without padding
  (``capability``, ``check_capability``). ``~`` is not in the episode-id alphabet
  (polar_contracts/episode_ids.py), so the split is unambiguous. A capability authorizes model
  calls of its own episode and nothing else: the agent holds its own, which is fine; it cannot
  make another episode's, nor end any episode, nor sync weights.

Bounds: a control body is at most ``MAX_CONTROL_BODY`` bytes (the proxy's option may lower or
raise it) and ``MAX_JSON_DEPTH`` levels deep, a reward finite and at most ``MAX_ABS_REWARD`` in
absolute value; a failed check is a ControlRequestError with its status (400, 403, 413).
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import secrets
import stat

from polar_contracts.episode_ids import EPISODE_ID_RULE, is_valid_episode_id
from polar_contracts.weight_versions import VERSION_RE, check_version, is_marker

EPISODE_HEADER = "x-polar-episode"
CONTROL_HEADER = "x-polar-control"  # the control secret, on every control request
PREFIX = "/polar/"
CONTROL_PREFIX = PREFIX + "@"  # /polar/@...: the proxy's own endpoints (no episode id has an @)
END = "end"
SYNC_PATH = "/polar/@weights"
HOLD_PATH = SYNC_PATH + "/hold"
RELEASE_PATH = SYNC_PATH + "/release"
ENDPOINTS = (SYNC_PATH, HOLD_PATH, RELEASE_PATH)
# GET /polar/@control: {"control": "secured" | "open"}, whether the proxy holds a control secret.
# A secured proxy answers it only with the secret (403 without, like every /polar/@ path), so the
# node learns both that the proxy is secured and that it holds the node's secret; an open proxy
# answers anyone. polar-rollout run asks it first and refuses an open proxy (see proxy_control).
STATUS_PATH = CONTROL_PREFIX + "control"
SECURED, OPEN = "secured", "open"
SYNC_BODY_KEYS = frozenset({"path", "version"})
SYNC_OPTIONAL_KEYS = frozenset({"peers_drained"})
HOLD_BODY_KEYS = frozenset({"version", "lease_s"})
RELEASE_BODY_KEYS = frozenset({"version", "weight_version", "ok"})
END_BODY_KEYS = frozenset({"reward", "metadata"})
MAX_LEASE_S = 24 * 3600.0
MAX_CONTROL_BODY = 64 * 1024  # bytes of a control request's body (an end record's metadata is small)
MAX_JSON_DEPTH = 32  # nesting of a control body: a 200k-deep one must not reach the JSON parser's recursion
MAX_ABS_REWARD = 1e6  # |reward|: 1e308 is finite but overflows the trainer's group std
CAP_SEP = "~"  # between the episode id and its mac in a capability (not in the episode-id alphabet)
MAC_BYTES = 16  # 128 bits of HMAC-SHA256
SECRET_BYTES = 32
_MAC_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")

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


# -- the control secret and episode capabilities ------------------------------------------------
def new_secret() -> str:
    """A fresh control secret (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def _key(secret: str) -> bytes:
    if not isinstance(secret, str) or len(secret) < 16:
        raise ValueError("a control secret must be a string of at least 16 characters (use new_secret())")
    return secret.encode("utf-8")


def _mac(secret: str, episode_id: str) -> str:
    digest = hmac.new(_key(secret), episode_id.encode("ascii"), hashlib.sha256).digest()[:MAC_BYTES]
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def capability(secret: str, episode_id: str) -> str:
    """``<episode_id>~<mac>``: names the episode in its model calls (URL path or header)."""
    if not is_valid_episode_id(episode_id):
        raise ValueError(f"invalid episode id {episode_id!r}: it must match {EPISODE_ID_RULE}")
    return f"{episode_id}{CAP_SEP}{_mac(secret, episode_id)}"


def capability_mac(cap: str) -> str:
    """The mac part of a capability (a credential: the proxy scrubs it from logs)."""
    return cap.rpartition(CAP_SEP)[2]


def is_capability(text: str) -> bool:
    return CAP_SEP in text


def check_capability(secret: str, cap: str) -> str:
    """The episode id a capability names; ControlRequestError 403 when it is not one this
    secret made (no ``~``, a bad id, a wrong mac). The mac is compared in constant time."""
    shown = cap if len(cap) <= 80 else cap[:80] + "..."
    episode_id, sep, mac = cap.rpartition(CAP_SEP)
    if not sep:
        raise ControlRequestError(f"episode {shown!r} is a bare episode id: this proxy requires the episode's "
                                  f"capability <episode_id>{CAP_SEP}<mac> (the rollout node hands it to the harness)",
                                  403)
    if not is_valid_episode_id(episode_id):
        raise ControlRequestError(f"capability {shown!r}: the episode id must match {EPISODE_ID_RULE}", 403)
    if not (mac and set(mac) <= _MAC_CHARS):
        raise ControlRequestError(f"capability of episode {episode_id!r}: the mac is not base64url text", 403)
    if not hmac.compare_digest(mac.encode("ascii"), _mac(secret, episode_id).encode("ascii")):
        raise ControlRequestError(f"capability of episode {episode_id!r}: wrong mac (not made with this proxy's "
                                  f"control secret)", 403)
    return episode_id


def check_secret(secret: str, given: str | None) -> None:
    """A control request's ``x-polar-control`` value against the secret (constant time);
    ControlRequestError 403 naming what is wrong (never the values)."""
    if not given:
        raise ControlRequestError(f"control request without header {CONTROL_HEADER}: this proxy's control plane "
                                  f"needs its control secret", 403)
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), _key(secret)):
        raise ControlRequestError(f"control request with a wrong {CONTROL_HEADER} secret", 403)


def status_body(secured: bool) -> dict[str, str]:
    """The answer to ``GET /polar/@control``."""
    return {"control": SECURED if secured else OPEN}


def control_headers(secret: str | None) -> dict[str, str]:
    """The header a control request carries (none without a secret: an open proxy)."""
    return {CONTROL_HEADER: secret} if secret else {}


def write_secret_file(path: str | os.PathLike, secret: str) -> None:
    """Write ``secret`` to a new file readable by its owner only (0600, created exclusively: an
    existing file or a planted symlink there is an error, never overwritten or followed)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, secret.encode("utf-8"))
    finally:
        os.close(fd)


def read_secret_file(path: str | os.PathLike) -> str:
    """The control secret in ``path``: a regular file (not a link) that only its owner can read
    or write; ValueError naming the problem otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ValueError(f"control secret file {str(path)!r} cannot be opened ({exc.strerror}; a symlink is "
                         f"refused)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"control secret file {str(path)!r} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(f"control secret file {str(path)!r} has mode {stat.S_IMODE(st.st_mode):04o}: it must "
                             f"be readable by its owner only (chmod 600)")
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    text = data.decode("utf-8", "replace").strip()
    if len(data) > 4096 or len(text) < 16 or any(c.isspace() for c in text):
        raise ValueError(f"control secret file {str(path)!r} must hold one secret of 16 to 4096 characters "
                         f"without whitespace (write one with new_secret())")
    return text


# -- bounded JSON ---------------------------------------------------------------------------------
def json_depth(raw: bytes) -> int:
    """The nesting depth of a JSON text, counted outside strings without parsing it (so a body
    200k levels deep is measured, not recursed into)."""
    depth = deepest = 0
    in_str = esc = False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


def load_control_json(raw: bytes, what: str, max_bytes: int = MAX_CONTROL_BODY) -> object:
    """A control body parsed with its size and depth bounded; ControlRequestError (413, 400)."""
    if len(raw) > max_bytes:
        raise ControlRequestError(f"{what} body is {len(raw)} bytes; at most {max_bytes} are accepted", 413)
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise ControlRequestError(f"{what} body is nested {depth} levels deep; at most {MAX_JSON_DEPTH} are accepted")

    def no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number (numbers such as a reward must be finite)")

    try:
        return json.loads(raw or b"", parse_constant=no_constant)
    except RecursionError:  # (the depth check above makes this unreachable; kept: fail closed)
        raise ControlRequestError(f"{what} body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlRequestError(f"{what} body is not valid JSON: {exc}") from None


def episode_prefix(episode_id: str) -> str:
    """The path prefix that names an episode: ``/polar/<episode_id>``."""
    return PREFIX + episode_id


def end_path(episode_id: str) -> str:
    """``/polar/<episode_id>/end``."""
    return f"{episode_prefix(episode_id)}/{END}"


def parse_end_body(body: bytes, max_abs_reward: float = MAX_ABS_REWARD,
                   max_bytes: int = MAX_CONTROL_BODY) -> tuple[float | None, dict]:
    """The body of POST /polar/<id>/end: {"reward": float, "metadata": {...}} (both optional);
    the reward finite and at most ``max_abs_reward`` in absolute value."""
    if len(body) > max_bytes:
        raise ControlRequestError(f"episode end body is {len(body)} bytes; at most {max_bytes} are accepted", 413)
    if not body.strip():
        return None, {}
    obj = load_control_json(body, "episode end", max_bytes)
    if not isinstance(obj, dict):
        raise ControlRequestError("episode end body must be a JSON object {\"reward\": float, \"metadata\": {...}}")
    unknown = set(obj) - END_BODY_KEYS
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
        if abs(reward) > max_abs_reward:
            raise ControlRequestError(f"reward {reward:g} is out of bounds: |reward| must be at most "
                                      f"{max_abs_reward:g} (option polar_max_abs_reward)")
    return reward, meta


def _json_object(raw: bytes, what: str, keys: frozenset, optional: frozenset = frozenset()) -> dict:
    obj = load_control_json(raw or b"", what)
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
