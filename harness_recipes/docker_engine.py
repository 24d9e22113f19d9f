"""The local docker engine, through the docker SDK: the one accessor runtimes, tasks and tools share.

`docker_client()` reaches the engine or raises, saying how to start it; `docker_client_or_none()` is
for callers that can work without one (the SWE-bench planner then finds no official image). The SDK
is imported here, on call: a node that never runs docker needs no docker package.
"""
from __future__ import annotations


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
