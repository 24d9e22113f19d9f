"""The local docker engine, through the docker SDK: the one accessor runtimes, tasks and tools share.

`docker_client()` reaches the engine or raises, saying how to start it; `docker_client_or_none()` is
for callers that can work without one (the SWE-bench planner then finds no official image). The SDK
is imported here, on call: a node that never runs docker needs no docker package.
"""
from __future__ import annotations

import time


class DockerUnavailable(RuntimeError):
    """No docker engine could be reached (no SDK, no socket, no permission, not running)."""


def docker_client(timeout: float = 120):
    """A docker SDK client for the local engine (`DOCKER_HOST` or the default socket), pinged once."""
    try:
        import docker
        client = docker.from_env(version="auto", timeout=timeout)
        client.ping()
    except Exception as e:  # ImportError, docker.errors.DockerException and connection errors alike
        raise DockerUnavailable(
            "docker runtime: cannot reach dockerd. Start it the quiet way: dockerd --iptables=false "
            f"--ip-forward=false --ip-masq=false --bridge=none ({type(e).__name__}: {e})") from None
    return client


def docker_client_or_none(timeout: float = 30):
    """The local engine's client, or None when none can be reached."""
    try:
        return docker_client(timeout)
    except DockerUnavailable:
        return None


# How long a finished command's exit code may lag behind its output (below).
EXIT_CODE_SETTLE = 10.0


def exec_wait(container, argv: list[str], environment: dict | None = None, workdir: str | None = None,
              settle: float = EXIT_CODE_SETTLE, sleep=time.sleep) -> tuple[int | None, tuple]:
    """`container.exec_run(argv, demux=True)` with the exit code waited for: (exit code, (stdout, stderr)).

    exec_run asks for the exit code once, the moment the output stream closes; the engine records it
    when the process's exit event arrives, which can come later (moby/moby#19607: the exec still
    reads Running, ExitCode null), and exec_run then says None. A None here means what callers take it
    for, a process that never reported an exit (its container died or was removed): it is asked again
    until ``settle`` seconds have passed or the exec no longer runs without a code."""
    api = container.client.api
    exec_id = api.exec_create(container.id, argv, environment=environment, workdir=workdir)["Id"]
    output = api.exec_start(exec_id, demux=True)
    deadline, delay = time.monotonic() + settle, 0.01
    while True:
        info = api.exec_inspect(exec_id)
        code = info.get("ExitCode")
        if code is not None and not info.get("Running"):
            return code, output
        if not info.get("Running") or time.monotonic() >= deadline:
            return None, output
        sleep(delay)
        delay = min(delay * 2, 0.5)
