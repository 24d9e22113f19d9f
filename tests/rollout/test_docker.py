"""The docker runtime for real: containers through the SDK, network none, limits, cleanup."""
from __future__ import annotations

import asyncio
from pathlib import Path

import harness_recipes.node.episode as ep
from harness_recipes.node.records import Records
from harness_recipes.node.scheduler import Limits, Pipeline
from harness_recipes.recipes.recipe import load_recipe
from harness_recipes.tasks.task_file import load_tasks

from .conftest import fake_harness_installed, write_tasks


def run_docker(tmp_path, monkeypatch, end_server, runtime_cls, argv, timeout=30, n=1):
    recipe_path, exe = fake_harness_installed(tmp_path, monkeypatch, argv)
    recipe = load_recipe(recipe_path)
    tasks = load_tasks(write_tasks(tmp_path, timeout=timeout, n=n))
    rt = runtime_cls(network="none", memory="1g", cpus=1.0, workdir=str(tmp_path))
    p = Pipeline(recipe, exe, rt, ep.Settings(proxy=end_server.url), Records(tmp_path / "out"),
                 logdir=None, limits=Limits())
    p.plan(tasks, 1)

    async def go():
        try:
            return await p.run()
        finally:
            await rt.shutdown()

    recs = asyncio.run(go())
    return rt, recs


def test_docker_fix_and_reward(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    rt, recs = run_docker(tmp_path, monkeypatch, end_server, docker_runtime_cls,
                          ["fix", "calc.py", "return a - b", "return a + b"], n=2)
    assert [r["status"] for r in recs] == ["done", "done"] and [r["reward"] for r in recs] == [1.0, 1.0], recs
    assert all(r["runtime"] == "docker" for r in recs)
    assert "calc.py" in recs[0]["changed_files"]
    assert rt.leftovers() == [], "containers left behind"
    assert not [d for d in tmp_path.iterdir() if d.name.startswith("polar-")]


def test_docker_hang_times_out_and_container_is_gone(tmp_path, monkeypatch, end_server, docker_runtime_cls):
    rt, (rec,) = run_docker(tmp_path, monkeypatch, end_server, docker_runtime_cls, ["hang", "/tmp/pids"], timeout=2)
    assert rec["status"] == "timeout" and rec["reward"] == 0.0
    assert rt.leftovers() == []


def test_docker_network_none_has_no_route(tmp_path, docker_runtime_cls):
    from harness_recipes.tasks.task_file import Task

    async def go():
        rt = docker_runtime_cls(network="none", workdir=str(tmp_path))
        sb = await rt.prepare(Task(id="t", prompt="p", eval_cmd="true"), "t.s0", Path("."))
        try:
            sb.container.reload()
            host = sb.container.attrs["HostConfig"]
            assert host["NetworkMode"] == "none" and host["Memory"] > 0 and host["PidsLimit"] > 0 and host["NanoCpus"] > 0
            assert host["Binds"] and all(b.endswith(":ro") for b in host["Binds"] if b.startswith(("/usr", "/etc")))
            return await sb.exec(["cat", "/proc/net/dev"], {"PATH": "/usr/bin"}, 20)
        finally:
            await sb.close()
            await rt.shutdown()

    res = asyncio.run(go())
    ifaces = [line.split(":")[0].strip() for line in res.stdout.decode().splitlines()[2:]]
    assert res.rc == 0 and ifaces == ["lo"], ifaces  # no interface but loopback: no route anywhere
