"""In a sandbox (bubblewrap, docker) the harness sees its own recipe's install prefix, not the whole
harness cache (other harnesses and their caches are not the agent's business; docs/security.md, "Sandboxes")."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from harness_recipes.cache import install_prefix
from harness_recipes.runtimes.local import LocalRuntime, bwrap_problem
from harness_recipes.tasks.task_file import Task

ROOT = Path(__file__).resolve().parents[2]
FIX_ADD = ROOT / "data" / "tasks" / "repos" / "fix_add"


def fake_cache(tmp_path: Path) -> tuple[Path, Path]:
    cache = tmp_path / "harnesses"
    exe = cache / "mine" / "node_modules" / ".bin" / "mine"
    exe.parent.mkdir(parents=True)
    real = cache / "mine" / "node_modules" / "mine" / "cli.sh"
    real.parent.mkdir(parents=True)
    real.write_text("#!/bin/sh\necho mine-ran\n")
    real.chmod(0o755)
    exe.symlink_to(Path("..") / "mine" / "cli.sh")
    (cache / "other").mkdir()
    (cache / "other" / "token.txt").write_text("another harness's credential")
    return cache, exe


def test_install_prefix(tmp_path, monkeypatch):
    cache, exe = fake_cache(tmp_path)
    monkeypatch.setenv("POLAR_HARNESS_CACHE", str(cache))
    assert install_prefix(exe) == cache / "mine"
    assert install_prefix(Path("/usr/bin/python3")) is None and install_prefix(cache) is None
    link = tmp_path / "link-to-cache"
    link.symlink_to(cache)
    monkeypatch.setenv("POLAR_HARNESS_CACHE", str(link))
    assert install_prefix(cache / "mine" / "x") in (link / "mine", cache / "mine")
    rt = LocalRuntime(isolation="none", workdir=str(tmp_path))
    assert str(cache) not in rt.binds(exe) and str(link) not in rt.binds(exe)


def test_the_sandbox_sees_its_own_prefix_only(tmp_path, monkeypatch):
    problem = bwrap_problem()
    if problem:
        msg = f"bubblewrap unusable here: {problem}"
        if os.environ.get("POLAR_NO_SKIP") == "1":
            pytest.fail(msg + " (POLAR_NO_SKIP=1)")
        print(msg)
        pytest.skip(msg)
    cache, exe = fake_cache(tmp_path)
    monkeypatch.setenv("POLAR_HARNESS_CACHE", str(cache))
    (tmp_path / "work").mkdir()
    rt = LocalRuntime(isolation="bwrap", workdir=str(tmp_path / "work"))

    assert_sees_own_prefix_only(rt, cache, exe)


def assert_sees_own_prefix_only(rt, cache: Path, exe: Path) -> None:
    task = Task(id="binds", prompt="p", eval_cmd="true", workspace_dir=FIX_ADD)

    async def go():
        sb = await rt.prepare(task, "binds.s0", exe)
        try:
            script = (f"{exe} && test -r {cache}/mine/node_modules/mine/cli.sh && "
                      f"! test -e {cache}/other && ! cat {cache}/other/token.txt 2>/dev/null && echo sealed")
            return await sb.exec(sb.harness_argv(["/bin/sh", "-c", script]),
                                 {"PATH": "/usr/bin:/bin", "HOME": sb.home}, timeout=60)
        finally:
            await sb.close()
            await rt.shutdown()

    res = asyncio.run(go())
    out = res.stdout.decode()
    assert res.rc == 0 and "mine-ran" in out and "sealed" in out, (out, res.stderr.decode()[-1000:])


def test_the_docker_sandbox_sees_its_own_prefix_only(tmp_path, monkeypatch, docker_runtime_cls):
    cache, exe = fake_cache(tmp_path)
    monkeypatch.setenv("POLAR_HARNESS_CACHE", str(cache))
    (tmp_path / "work").mkdir()
    assert_sees_own_prefix_only(docker_runtime_cls(memory="512m", cpus=1.0, workdir=str(tmp_path / "work")), cache, exe)
