"""Token authentication for the Ray clusters the fleet starts (Ray 2.60: RAY_AUTH_MODE=token).

Without it anyone who reaches the GCS port can run code on every node. `polar-rollout fleet --local N`
generates a fresh token per run into a 0600 file in a 0700 directory and starts its nodes with
RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH pointing at it; the file is removed when the cluster
stops. The token lives only in the Ray processes' environment: a sandbox's environment is built from
scratch (node/episode.py harness_env), and no sandbox sees the host's /tmp.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

MODE_ENV, TOKEN_ENV, PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
AUTH_ENV = (MODE_ENV, TOKEN_ENV, PATH_ENV)


def write_token(directory: Path) -> Path:
    """A fresh random token in ``directory``/token, readable by its owner only."""
    path = directory / "token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


@contextlib.contextmanager
def token_auth() -> Iterator[Path]:
    """This process (and the Ray processes it starts) in token mode with a new per-run token."""
    saved = {k: os.environ.get(k) for k in AUTH_ENV}
    directory = Path(tempfile.mkdtemp(prefix="polar-ray-auth-"))  # mkdtemp: mode 0700
    try:
        path = write_token(directory)
        os.environ.pop(TOKEN_ENV, None)
        os.environ.update({MODE_ENV: "token", PATH_ENV: str(path)})
        _refresh()
        yield path
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh()
        shutil.rmtree(directory, ignore_errors=True)


def _refresh() -> None:
    """Ray's C++ side caches the auth mode and token per process (read once, at import): make it read
    the environment again, as Ray's own token setup does (authentication_token_setup.py)."""
    from ray._raylet import AuthenticationTokenLoader, Config
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
