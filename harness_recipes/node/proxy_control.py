"""Before any episode runs: is the capture proxy's control plane secured, with the node's secret?

An open proxy (started without ``polar_control_secret_file``) lets anything that reaches it end
episodes with a reward of its choosing: the agent under training reaches it (its model calls go
through it). So ``polar-rollout run`` asks ``GET /polar/@control`` first (polar_contracts/control.py)
and refuses an open proxy, saying how to start it securely, unless the user opts in explicitly
(``--unsafe-open-proxy``); every episode's end metadata then says ``"control_plane": "open"``
and polar-recon copies that onto every row (shard column ``control_plane``).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request

from polar_contracts.control import OPEN, SECURED, STATUS_PATH, control_headers

# Every step runs as written in the directory the user is in (no system directory that may not exist).
HOW_TO_SECURE = (
    "Start the proxy with a control secret: write one with\n"
    "  polar-rollout secret polar-control-secret\n"
    "restart mitmdump with --set polar_control_secret_file=polar-control-secret, and pass "
    "--control-secret-file polar-control-secret here (docs/security.md).")


class ProxyControlError(Exception):
    """The proxy's control plane is not one this node may run episodes against; says why and what to do."""


def decide(proxy: str, status: int, body: bytes, have_secret: bool, allow_open: bool) -> str:
    """The proxy's control plane (SECURED | OPEN) from its answer to GET /polar/@control, or
    ProxyControlError when the node must not run against it (sans-IO: the caller did the GET)."""
    if status == 403:
        if have_secret:
            raise ProxyControlError(f"the capture proxy at {proxy} refused this node's control secret: "
                                    f"--control-secret-file is not the file this proxy was started with "
                                    f"(its polar_control_secret_file)")
        raise ProxyControlError(f"the capture proxy at {proxy} holds a control secret: pass --control-secret-file "
                                f"with the file it was started with (its polar_control_secret_file)")
    try:
        control = json.loads(body)["control"] if status == 200 else None
    except (ValueError, KeyError, TypeError):
        control = None
    if control not in (SECURED, OPEN):
        raise ProxyControlError(f"{proxy} did not answer GET {STATUS_PATH} as a Polar capture proxy does "
                                f"(HTTP {status}: {body[:200]!r}); is --proxy the capture proxy's URL?")
    if control == OPEN and not allow_open:
        raise ProxyControlError(
            f"the capture proxy at {proxy} has an OPEN control plane (it was started without a control secret): "
            f"the agent under training reaches it through its model API and could end its own and its siblings' "
            f"episodes with any reward, or make the server load weights of its choosing.\n{HOW_TO_SECURE}\n"
            f"To run anyway (every row is then marked control_plane=open), pass --unsafe-open-proxy.")
    return control


def check_proxy(proxy: str, secret: str | None, allow_open: bool, timeout: float = 10.0) -> str | None:
    """Ask the proxy; SECURED | OPEN, or None when it could not be reached (the caller warns: the
    episodes then fail on their own, recorded). Raises ProxyControlError as ``decide``."""
    req = urllib.request.Request(proxy.rstrip("/") + STATUS_PATH, headers=control_headers(secret))
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # (never via an http_proxy: the secret)
    try:
        with opener.open(req, timeout=timeout) as r:
            status, body = r.status, r.read(4096)
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read(4096)
    except (OSError, ValueError):  # (URLError, refused, timeout)
        return None
    return decide(proxy, status, body, secret is not None, allow_open)
