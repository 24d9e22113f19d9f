"""Gemini CLI and OpenCode, run as their recipes configure them, open connections to loopback only.

Each recipe's command line, environment and config files (rendered as polar-rollout renders them)
run the fix-add prompt under `strace -f -e trace=connect` against the capture proxy and scripted
polar-serve; every IPv4/IPv6 connect must go to 127.0.0.1 / ::1 (telemetry, update checks, model
catalogues and package installs all off or sent to a closed loopback port).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.recipes.install import ensure_installed
from harness_recipes.recipes.recipe import load_recipe

CONNECT = re.compile(r"connect\(\d+, \{sa_family=(AF_INET6?), (.*?)\}")
ADDR = re.compile(r'inet_(?:addr|pton)\((?:AF_INET6, )?"([^"]+)"')


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from harness_recipes.compat import SCRIPT
    from tests.support.servers import tiny_model_dir
    logdir = tmp_path_factory.mktemp("logs")
    with serve(tiny_model_dir(), script=SCRIPT) as srv, capture_proxy(srv.url, logdir, control_secret=None) as proxy:
        proxy.logdir = logdir
        yield proxy


def remote_connects(trace: str) -> tuple[int, list[str]]:
    """(inet connects seen, the ones to an address that is not loopback)."""
    seen, bad = 0, []
    for fam, rest in CONNECT.findall(trace):
        seen += 1
        m = ADDR.search(rest)
        addr = m.group(1) if m else rest
        if addr not in ("127.0.0.1", "::1", "::ffff:127.0.0.1"):
            bad.append(f"{fam} {rest}")
    return seen, bad


@pytest.mark.parametrize("name", ["gemini-cli", "opencode"])
def test_the_harness_talks_to_loopback_only(stack, tmp_path, name):
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (apt-get install -y strace)")
    recipe = load_recipe(name)
    exe = ensure_installed(recipe)
    home, work = tmp_path / "home", tmp_path / "work"
    from harness_recipes.compat import TASKS
    task = json.loads((TASKS / "tasks.jsonl").read_text().splitlines()[0])
    shutil.copytree(TASKS / task["workspace"], work)
    home.mkdir()
    eid = f"loopback-{name}"
    base = stack.url + (f"/polar/{eid}" if recipe.episode_via == "path" else "")
    values = {"bin": str(exe), "prefix": str(exe.parent), "home": str(home), "workspace": str(work),
              "prompt": task["prompt"], "model": "polar-model", "api_key": "polar-local-key",
              "episode": eid, "proxy": stack.url, "base_url": base, "episode_header": recipe.episode_header,
              "task_id": eid}
    for path, content in recipe.render_files(values):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(content)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", **recipe.render_env(values)}
    trace = tmp_path / "connect.strace"
    proc = subprocess.run(["strace", "-f", "-qq", "-e", "trace=connect", "-o", str(trace),
                           *recipe.render_argv(values)], cwd=work, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a + b" in (work / "calc.py").read_text(), proc.stdout[-2000:]
    seen, bad = remote_connects(trace.read_text())
    assert seen > 0, "strace saw no connect at all: the trace is not working"
    assert not bad, f"{name} connected off loopback: {bad[:10]}"
    # and its model calls reached the proxy under the episode's id
    from polar_contracts.log.reader import read_episode
    calls = read_episode(stack.logdir / f"{eid}.arrow").calls
    assert calls.height >= 3 and calls["error"].is_null().all()


def test_remote_connects_are_recognised():
    trace = ('123 connect(20, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("142.250.1.1")}, 16) = 0\n'
             '123 connect(21, {sa_family=AF_INET, sin_port=htons(80), sin_addr=inet_addr("127.0.0.1")}, 16) = 0\n'
             '123 connect(22, {sa_family=AF_INET6, sin6_port=htons(443), sin6_flowinfo=htonl(0), '
             'inet_pton(AF_INET6, "2a00:1450::1", &sin6_addr), sin6_scope_id=0}, 28) = 0\n'
             '123 connect(23, {sa_family=AF_UNIX, sun_path="/run/x"}, 110) = 0\n')
    seen, bad = remote_connects(trace)
    assert seen == 3 and len(bad) == 2 and "142.250.1.1" in bad[0] and "2a00:1450::1" in bad[1]
