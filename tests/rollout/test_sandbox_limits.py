"""One sandbox's bombs stay in it: a fork bomb, a memory bomb and a disk filler each end their own
episode with a limit (ExecResult.limit, the episode's resource_limit) while the node (this process),
its proxy (a host HTTP server every sandbox reaches through its API socket) and the other episodes
go on; on bubblewrap and on docker.

Every bomb runs with small limits already in place (256 MiB, 64 processes, 64 MiB of disk) and is
bounded on its own too (the filler stops after 40 files of 8 MiB, the memory bomb after 2 GiB), so a
broken limit fails the test instead of taking this machine down. Also here: the agent is not root on
the host, its seccomp filter refuses the keyring, namespaces and ptrace, /proc/keys is hidden.
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harness_recipes.node import episode as ep
from harness_recipes.recipes.limits import Limits, parse_limits, parse_size
from harness_recipes.recipes.recipe import RecipeError, parse_recipe
from harness_recipes.runtimes import make_runtime
from harness_recipes.tasks.task_file import Task

ROOT = Path(__file__).resolve().parents[2]
FIX_ADD = ROOT / "data" / "tasks" / "repos" / "fix_add"
SMALL = Limits(memory=256 << 20, pids=64, cpus=1.0, disk=64 << 20, disk_poll=0.2)

BOMBS = {
    "fork": "bash -c 'b(){ b | b & }; b; sleep 60'",
    # 16 MiB at a time, at most 2 GiB: past the 256 MiB limit long before its own bound
    "memory": "python3 -c 'b=[]\nfor _ in range(128): b.append(bytearray(16<<20))\nimport time; time.sleep(60)'",
    # 8 MiB files, at most 40 of them, in the workspace: past the 64 MiB limit at the ninth
    "disk": "for i in $(seq 40); do head -c 8M /dev/zero > fill$i || exit 3; sleep 0.05; done; sleep 60",
}
LIMIT_WORDS = {"fork": "process limit 64 reached", "memory": "memory limit 256 MiB reached",
               "disk": "disk limit 64 MiB reached"}
# An honest episode: some work, calls to its model API (the "proxy") while the bomb goes off, a file.
HONEST = r'''
import json, os, sys, time, urllib.request
api = sys.argv[1]
t0 = time.monotonic()
for i in range(6):
    with urllib.request.urlopen(api + "/ping/" + str(i), timeout=20) as r:
        assert json.loads(r.read())["pong"] == str(i)
    sum(x * x for x in range(200000))
    time.sleep(0.3)
open("done.txt", "w").write("ok")
print(json.dumps({"seconds": time.monotonic() - t0}))
'''


class Proxy:
    """A stand-in for the episode's capture proxy on the host: answers GET /ping/N with {"pong": N}."""

    def __init__(self):
        self.calls = 0

        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.calls += 1
                body = json.dumps({"pong": self.path.rsplit("/", 1)[-1]}).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def make(runtime: str, tmp_path: Path, limits: Limits = SMALL):
    if runtime == "docker":
        from harness_recipes.docker_engine import docker_client
        try:
            docker_client()
        except RuntimeError as e:
            pytest.skip(f"dockerd not reachable, the docker runtime's limits are not tested here: {e}")
        return make_runtime("docker", workdir=str(tmp_path), limits=limits)
    try:
        return make_runtime("local", isolation="bwrap", workdir=str(tmp_path), limits=limits)
    except RuntimeError as e:
        if os.geteuid() != 0:
            pytest.skip(f"not root: this node cannot create cgroups for the sandbox limits ({e})")
        raise


ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}


async def _episodes(rt, bomb: str | None, honest: int, proxy: Proxy) -> tuple[list, object | None]:
    task = Task(id="limits", prompt="p", eval_cmd="true", workspace_dir=FIX_ADD)
    boxes = [await rt.prepare(task, f"honest{i}.s0", Path("/usr/bin/python3"), upstream=proxy.url)
             for i in range(honest)]
    bad = await rt.prepare(task, "bomb.s0", Path("/usr/bin/python3")) if bomb else None
    try:
        runs = [sb.exec(sb.harness_argv([sb.python, "-c", HONEST, sb.api_base(proxy.url)]),
                        {**ENV, "HOME": sb.home}, timeout=120) for sb in boxes]
        if bad is not None:
            runs.append(bad.exec(["sh", "-c", BOMBS[bomb]], {**ENV, "HOME": bad.home}, timeout=60))
        results = await asyncio.gather(*runs)
        for sb in boxes:  # the honest episodes' work is there
            assert (Path(sb.workspace) / "done.txt").read_text() == "ok"
        return results[:honest], (results[honest] if bad is not None else None)
    finally:
        for sb in [*boxes, *([bad] if bad else [])]:
            await sb.close()


@pytest.mark.parametrize("runtime", ["bubblewrap", "docker"])
@pytest.mark.parametrize("bomb", ["fork", "memory", "disk"])
def test_a_bomb_ends_its_own_episode_only(runtime, bomb, tmp_path):
    proxy = Proxy()
    rt = make(runtime, tmp_path)

    async def go():
        try:
            return await _episodes(rt, bomb, 2, proxy)
        finally:
            await rt.shutdown()
    try:
        t0 = time.monotonic()
        honest, hit = asyncio.run(go())
        took = time.monotonic() - t0
    finally:
        proxy.close()
    assert LIMIT_WORDS[bomb] in hit.limit, (hit.limit, hit.stderr[-500:])
    assert hit.rc is None and not hit.timed_out
    assert ep.harness_status(hit) == ep.RESOURCE_LIMIT
    assert took < 60, f"the bomb was not stopped at its limit: {took:.1f}s"  # its own bound is 60 s of sleep
    for res in honest:
        assert res.rc == 0 and not res.limit, (res.limit, res.stderr[-1000:])
        assert ep.harness_status(res) == ep.DONE
    assert proxy.calls == 12  # every honest call answered, while the bomb went off


def test_concurrent_bubblewrap_episodes_one_fork_bombing(tmp_path, capsys):
    """N honest bubblewrap episodes alongside one fork bomb all finish, about as fast as without it
    (the bench line in docs/benchmarks/sandboxes.md comes from this test's output)."""
    n = 4
    proxy = Proxy()
    rt = make("bubblewrap", tmp_path)

    async def go(bomb):
        return await _episodes(rt, bomb, n, proxy)
    try:
        quiet, _ = asyncio.run(go(None))
        loud, hit = asyncio.run(go("fork"))
        asyncio.run(rt.shutdown())
    finally:
        proxy.close()
    assert "process limit" in hit.limit
    for res in quiet + loud:
        assert res.rc == 0 and not res.limit, res.stderr[-1000:]
    secs = [sorted(json.loads(r.stdout.decode().splitlines()[-1])["seconds"] for r in rs) for rs in (quiet, loud)]
    with capsys.disabled():
        print(f"\nsandbox-bench: {n} honest bubblewrap episodes, p50 {secs[0][n // 2]:.2f}s max {secs[0][-1]:.2f}s; "
              f"with a fork bomb beside them: p50 {secs[1][n // 2]:.2f}s max {secs[1][-1]:.2f}s "
              f"(bomb stopped: {hit.limit}, after {hit.seconds:.2f}s)")
    assert proxy.calls == 12 * n


def test_the_agent_is_not_root_and_its_syscalls_are_filtered(tmp_path):
    rt = make("bubblewrap", tmp_path)
    probe = r'''
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    rc = libc.syscall(nr, *args)
    return "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
out = {"uid": os.getuid(), "euid": os.geteuid()}
out["keyctl"] = call(250, 0, -3, 0)        # KEYCTL_GET_KEYRING_ID of the user keyring (x86_64)
out["add_key"] = call(248, b"user", b"k", b"v", 1, -4)
out["unshare_user"] = call(272, 0x10000000)  # unshare(CLONE_NEWUSER)
out["ptrace"] = call(101, 16, 1, 0, 0)       # PTRACE_ATTACH to pid 1
try:
    out["proc_keys"] = open("/proc/keys").read()
except OSError as e:
    out["proc_keys"] = f"unreadable: {e.strerror}"
open("mine.txt", "w").write("x")
print(json.dumps(out))
'''

    async def go():
        task = Task(id="who", prompt="p", eval_cmd="true", workspace_dir=FIX_ADD)
        sb = await rt.prepare(task, "who.s0", Path("/usr/bin/python3"))
        try:
            res = await sb.exec([sb.python, "-c", probe], {**ENV, "HOME": sb.home}, timeout=60)
            return res, os.stat(Path(sb.workspace) / "mine.txt").st_uid
        finally:
            await sb.close()
            await rt.shutdown()
    res, owner = asyncio.run(go())
    assert res.rc == 0, res.stderr.decode()[-1000:]
    out = json.loads(res.stdout.decode().splitlines()[-1])
    if os.uname().machine == "x86_64":  # the syscall numbers above are x86_64's
        assert out["keyctl"] == out["add_key"] == out["unshare_user"] == out["ptrace"] == "EPERM", out
    assert out["proc_keys"] in ("", "unreadable: Permission denied"), out
    assert owner != 0, "a file the agent wrote belongs to root on the host"
    if os.geteuid() == 0:
        assert out["uid"] == out["euid"] == owner == 65534, out


def test_limits_parse_and_merge():
    assert parse_size("256m", "x") == 256 << 20 and parse_size("4GiB", "x") == 4 << 30
    assert parse_size("0", "x") == 0 and parse_size("none", "x") == 0 and parse_size(1024, "x") == 1024
    for bad in ("lots", "-1m", "4q", True):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad, "--memory")
    base = Limits().merged({"memory": "1g", "pids": 100, "cpus": None})
    assert (base.memory, base.pids, base.cpus, base.disk) == (1 << 30, 100, Limits().cpus, Limits().disk)
    assert Limits().merged({"memory": "2g"}).merged({"memory": "512m"}).memory == 512 << 20  # the last wins
    with pytest.raises(ValueError, match="unknown limit"):
        Limits().merged({"swap": "1g"})
    with pytest.raises(ValueError, match="below 16 MiB"):
        Limits(memory=1 << 20)
    with pytest.raises(ValueError, match="whole number"):
        parse_limits({"pids": "many"})


def test_recipe_limits_table_is_checked_and_used(tmp_path):
    base = {"name": "x", "api": "chat", "install": {"kind": "none"}, "episode": {"via": "header"},
            "run": {"argv": ["true"]}}
    r = parse_recipe({**base, "limits": {"memory": "8g", "pids": 2048}}, tmp_path / "x.toml")
    assert r.limits == {"memory": "8g", "pids": 2048}
    with pytest.raises(RecipeError, match=r"\[limits\].*memory"):
        parse_recipe({**base, "limits": {"memory": "huge"}}, tmp_path / "x.toml")
    with pytest.raises(RecipeError, match="unknown limit"):
        parse_recipe({**base, "limits": {"gpus": 1}}, tmp_path / "x.toml")
    # the command line over the recipe over the defaults (make_runtime)
    rt = make_runtime("local", isolation="none", workdir=str(tmp_path), recipe_limits=r.limits,
                      limits={"memory": "1g"})
    assert (rt.limits.memory, rt.limits.pids, rt.limits.disk) == (1 << 30, 2048, Limits().disk)
