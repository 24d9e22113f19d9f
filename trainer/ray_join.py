"""Join a running Ray cluster, or fail at once with an error naming the address.

``ray.init(address=HOST:PORT)`` with nothing listening there retries for minutes (its GCS client
waits for the head to come up), and ``address="auto"`` with a stale ``ray_current_cluster`` file
does the same. A fleet driver or a trainer given a wrong address should say so in seconds: the
address is resolved as Ray resolves it (RAY_ADDRESS, then the last cluster started on this host)
and its GCS port is probed with a plain TCP connect before Ray is asked to join.

Used by ``polar-rollout fleet --ray-address`` (harness_recipes/fleet/driver.py) and the trainer's
``sync_mode=fleet`` (weight_sync.py). Ray is imported only when called.
"""
from __future__ import annotations

import os
import socket

PROBE_S = 5.0


class RayJoinError(ConnectionError):
    """No Ray cluster answers at the address; the message names it."""


def resolve(address: str) -> str:
    """``auto`` | ``HOST:PORT`` -> the ``HOST:PORT`` of the cluster's GCS, as ``ray.init`` would pick it."""
    from ray._private.services import canonicalize_bootstrap_address_or_die

    try:
        return canonicalize_bootstrap_address_or_die(address)
    except (ConnectionError, ValueError) as exc:
        raise RayJoinError(f"Ray address {address!r}: {exc}") from None


def probe(hostport: str, timeout: float = PROBE_S) -> None:
    host, _, port = hostport.rpartition(":")
    try:
        port_n = int(port)
    except ValueError:
        raise RayJoinError(f"Ray address {hostport!r} is not HOST:PORT") from None
    try:
        with socket.create_connection((host.strip("[]"), port_n), timeout=timeout):
            pass
    except OSError as exc:
        raise RayJoinError(f"no Ray cluster answers at {hostport} (nothing accepts a connection on the head's GCS "
                           f"port within {timeout:g} s: {exc}); start one with `ray start --head` or give its "
                           f"address") from None


def join(address: str, *, probe_timeout: float = PROBE_S) -> str:
    """Connect this process to the cluster at ``address`` (``auto`` | ``HOST:PORT``); returns the
    ``HOST:PORT`` joined. RayJoinError (in seconds, not minutes) when nothing answers there."""
    import ray

    if address.startswith("ray://"):  # Ray Client: its own server port, probed the same way
        probe(address[len("ray://"):].split("/", 1)[0], probe_timeout)
        ray.init(address=address, log_to_driver=False)
        return address
    hostport = resolve(address)
    probe(hostport, probe_timeout)
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ.setdefault(AUTH_MODE, "token")  # the token is read from RAY_AUTH_TOKEN(_PATH)
    try:
        ray.init(address=hostport, log_to_driver=False)
    except ConnectionError as exc:
        raise RayJoinError(f"Ray refused to let this process join {hostport} ({exc}). A cluster polar-rollout "
                           f"starts uses token authentication: {TOKEN_HINT}" + ("" if has_token() else
                           " (no token is set here)")) from None
    return hostport


AUTH_MODE = "RAY_AUTH_MODE"
TOKEN_HINT = ("set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH to the cluster's token file (or RAY_AUTH_TOKEN "
              "to the token), the one its head was started with")


def has_token() -> bool:
    """A Ray token is configured for this process: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token."""
    from pathlib import Path
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or bool(path and Path(path).is_file()) or \
        (Path.home() / ".ray" / "auth_token").is_file()
