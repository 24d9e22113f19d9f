"""A command's exit code in a docker sandbox, when the engine reports it late.

docker's exec inspect can still read Running, ExitCode null, a moment after the command's output
stream closed (moby/moby#19607: the exit event is handled apart from the streams). docker-py's
exec_run asks once and returns None; the sandbox took None for a dead container, so a command that
ran fine on a loaded node failed its episode as an infrastructure error (status error, discarded, no
log when it happened at prewarm). docker_engine.exec_wait asks again until the code is there.

The engine is real; only its exec-inspect answers are held back, as a loaded engine's are.
"""
from __future__ import annotations

import asyncio

import pytest

from harness_recipes.docker_engine import exec_wait
from harness_recipes.runtimes.docker import ContainerGone

from .conftest import write_tasks


class LateApi:
    """An engine API whose exec inspect says "still running, no exit code" ``lag`` times per exec."""

    def __init__(self, lag: int, code: int | None = 0, running_forever: bool = False):
        self.lag, self.code, self.running_forever = lag, code, running_forever
        self.asked: dict[str, int] = {}

    def exec_create(self, cid, argv, environment=None, workdir=None):
        return {"Id": f"x{len(self.asked)}"}

    def exec_start(self, exec_id, demux=False):
        self.asked[exec_id] = 0
        return (b"out", b"err")

    def exec_inspect(self, exec_id):
        self.asked[exec_id] += 1
        if self.running_forever or self.asked[exec_id] <= self.lag:
            return {"Running": True, "ExitCode": None}
        return {"Running": False, "ExitCode": self.code}


class Container:
    def __init__(self, api):
        self.id = "c"
        self.client = type("Client", (), {"api": api})()


def test_a_late_exit_code_is_waited_for():
    api = LateApi(lag=5, code=3)
    slept = []
    assert exec_wait(Container(api), ["true"], sleep=slept.append) == (3, (b"out", b"err"))
    assert api.asked == {"x0": 6} and len(slept) == 5 and slept == sorted(slept)


def test_an_exec_that_never_reports_an_exit_says_none():
    """A process that never reports its exit (its container died under it) is None, after the settle time."""
    api = LateApi(lag=0, running_forever=True)
    code, out = exec_wait(Container(api), ["true"], settle=0.05)
    assert code is None and out == (b"out", b"err") and api.asked["x0"] >= 2
    # not running and no code at all: None at once
    api = LateApi(lag=0, code=None)
    assert exec_wait(Container(api), ["true"], settle=30)[0] is None and api.asked["x0"] == 1


@pytest.fixture
def late_engine(monkeypatch):
    """The real engine's client, its exec inspect answering "still running, no code" twice per exec."""
    import docker.api.exec_api as exec_api
    real = exec_api.ExecApiMixin.exec_inspect
    seen: dict[str, int] = {}

    def late(self, exec_id):
        seen[exec_id] = seen.get(exec_id, 0) + 1
        if seen[exec_id] <= 2:
            return {**real(self, exec_id), "Running": True, "ExitCode": None}
        return real(self, exec_id)
    monkeypatch.setattr(exec_api.ExecApiMixin, "exec_inspect", late)
    return seen


def test_a_docker_sandbox_gets_the_exit_code_of_a_late_engine(tmp_path, docker_runtime_cls, late_engine):
    """Every command's exit code arrives late: the sandbox still returns each one (before, a None was a
    dead container: ContainerGone, the episode an infrastructure error); a removed container is still one."""
    from harness_recipes.tasks.task_file import load_tasks
    task = load_tasks(write_tasks(tmp_path))[0]
    rt = docker_runtime_cls(network="none", memory="256m", workdir=str(tmp_path))

    async def go():
        sb = await rt.prepare(task, "late.s0", tmp_path / "no-harness")
        try:
            ok = await sb.exec(["sh", "-c", "echo hi; exit 7"], {"PATH": "/usr/bin:/bin"}, timeout=30)
            fine = await sb.exec(["true"], {"PATH": "/usr/bin:/bin"}, timeout=30)
            sb.container.remove(force=True)
            with pytest.raises(ContainerGone):
                await sb.exec(["true"], {"PATH": "/usr/bin:/bin"}, timeout=30)
            return ok, fine
        finally:
            await sb.close()
            await rt.shutdown()
    ok, fine = asyncio.run(go())
    assert (ok.rc, ok.stdout, fine.rc) == (7, b"hi\n", 0), (ok, fine)
    assert late_engine and all(n >= 3 for n in late_engine.values()), late_engine
