"""The Ray clusters the fleet starts use token authentication; a sandbox cannot reach their GCS.

`Cluster(local=1)` (what `polar-rollout fleet --local N` runs) starts its head with RAY_AUTH_MODE=token
and a fresh per-run token in a 0600 file; a process without the token cannot join (a clear
RayJoinError naming the fix); the token file is gone when the cluster stops. From inside a
bubblewrap sandbox, and a docker one, a TCP connection to the head's GCS port fails.
"""
from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from harness_recipes.fleet.ray_auth import AUTH_ENV
from harness_recipes.tasks.task_file import Task

ROOT = Path(__file__).resolve().parents[2]
CONNECT = ("import socket, sys\nfor host in sys.argv[2:]:\n    try:\n"
           "        socket.create_connection((host, int(sys.argv[1])), timeout=3).close(); print('connected', host)\n"
           "    except OSError as e:\n        print('failed', host, e)\n")


def sandbox_connect(runtime, tmp_path: Path, port: int, hosts: list[str]) -> str:
    async def go():
        sb = await runtime.prepare(Task(id="t", prompt="p", eval_cmd="true"), "gcs.s0", Path("/usr/bin/python3"))
        try:
            res = await sb.exec([sb.python, "-c", CONNECT, str(port), *hosts], {"PATH": "/usr/bin:/bin"}, timeout=60)
            return res.stdout.decode() + res.stderr.decode()
        finally:
            await sb.close()
            await runtime.shutdown()
    return asyncio.run(go())


def test_local_cluster_uses_token_auth_and_sandboxes_cannot_reach_it(tmp_path):
    pytest.importorskip("ray", reason="the fleet needs ray (pip install polar[fleet])")
    from harness_recipes.fleet.driver import Cluster
    from harness_recipes.runtimes.local import LocalRuntime
    before = {k: os.environ.get(k) for k in AUTH_ENV}
    with Cluster(local=1) as c:
        token = c.token_path
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
        assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
        assert len(token.read_text()) == 64
        host, port = c.cluster.address.rsplit(":", 1)
        # Without the token: refused, and the error says what to set.
        env = {k: v for k, v in os.environ.items() if k not in AUTH_ENV}
        env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token either
        proc = subprocess.run([sys.executable, "-c", f"from trainer.ray_join import join; join({c.cluster.address!r})"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "RayJoinError" in proc.stderr, proc.stderr[-2000:]
        assert "token authentication" in proc.stderr and "RAY_AUTH_TOKEN_PATH" in proc.stderr, proc.stderr[-2000:]
        # The GCS port is not reachable from a sandbox (its own network namespace).
        out = sandbox_connect(LocalRuntime(isolation="bwrap", workdir=str(tmp_path)), tmp_path, int(port),
                              [host, "127.0.0.1"])
        assert "connected" not in out and out.count("failed") == 2, out
        try:
            from harness_recipes.docker_engine import docker_client
            from harness_recipes.runtimes.docker import DockerRuntime
            docker_client()
        except RuntimeError as e:
            pytest.skip(f"dockerd not reachable, the docker half is not tested here: {e}")
        out = sandbox_connect(DockerRuntime(memory="1g", cpus=1.0, workdir=str(tmp_path)), tmp_path, int(port),
                              [host, "127.0.0.1"])
        assert "connected" not in out and out.count("failed") == 2, out
    assert not token.exists(), "the per-run token outlived its cluster"
    assert {k: os.environ.get(k) for k in AUTH_ENV} == before
