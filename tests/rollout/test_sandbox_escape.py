"""The agent is an adversary: from inside each runtime's sandbox, a scripted command tries every way out.

Each runtime (local + bubblewrap, docker) gets a sandbox the way the scheduler makes one (prepare
with the episode's proxy as upstream) and runs a probe the way node/episode.py runs a harness (behind
the inner forwarder, sandbox.harness_argv). The probe tries to connect to a canary listener on the
host's 127.0.0.1, the proxy's port directly, the inference server's port, a Ray-GCS-like port and a
host abstract Unix socket; to smuggle a request to the canary through the forwarder (CONNECT,
absolute-form URL); to read the checkout, LOGDIR, OUT, the rest of $POLAR_CACHE, another episode's
workspace, /root (the mitmproxy CA key lives there) and /etc/shadow; to see host processes or a Ray
token in its environment. Every one must fail, and the model API must work: a real chat call through
the forwarders, a real mitmdump + Polar addon and a scripted polar-serve, captured under the episode.

The same probe unsandboxed (isolation none) must find the ways out: the test can fail.
"""
from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import harness_recipes.node.episode as ep
from harness_recipes.cache import polar_cache
from harness_recipes.node.local_stack import capture_proxy, serve
from harness_recipes.tasks.task_file import Task
from polar_contracts.control import EPISODE_HEADER, capability
from polar_contracts.log.reader import LogError, read_episode

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "data" / "scripts" / "create_hello.json"
FIX_ADD = ROOT / "data" / "tasks" / "repos" / "fix_add"

PROBE = r'''
import json, os, socket, sys, urllib.request
spec = json.loads(sys.argv[1])
out = {"connect": {}, "read": {}}

def connect(port):
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect(("127.0.0.1", port))
        return "connected"
    except OSError as e:
        return f"failed: {e}"
    finally:
        s.close()

for name, port in spec["ports"].items():
    out["connect"][name] = connect(port)
a = socket.socket(socket.AF_UNIX)
try:
    a.connect("\0" + spec["abstract"])
    out["connect"]["abstract"] = "connected"
except OSError as e:
    out["connect"]["abstract"] = f"failed: {e}"
for name, path in spec["paths"].items():
    try:
        if os.path.isdir(path):
            out["read"][name] = "listed: " + ",".join(sorted(os.listdir(path)))
        else:
            with open(path, "rb") as f:
                data = f.read()
            out["read"][name] = f"read {len(data)} bytes" if data else "empty"
    except OSError as e:
        out["read"][name] = f"failed: {type(e).__name__}"
body = {"model": "polar-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False}
req = urllib.request.Request(spec["api"] + "/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json", spec["header"]: spec["episode"]})
try:
    with urllib.request.urlopen(req, timeout=60) as r:
        out["api"] = [r.status, json.loads(r.read())["choices"][0]["message"].get("content")]
except Exception as e:
    out["api"] = [None, f"{type(e).__name__}: {e}"]
canary = spec["ports"]["canary"]
for how, head in (("smuggle_connect", f"CONNECT 127.0.0.1:{canary} HTTP/1.1\r\nHost: 127.0.0.1:{canary}\r\n\r\n"),
                  ("smuggle_absolute", f"GET http://127.0.0.1:{canary}/ HTTP/1.1\r\nHost: 127.0.0.1:{canary}\r\n"
                                       "Connection: close\r\n\r\n")):
    try:
        s = socket.create_connection(("127.0.0.1", spec["api_port"]), timeout=10)
        s.sendall(head.encode())
        out[how] = s.recv(200).decode(errors="replace")
        s.close()
    except OSError as e:
        out[how] = f"failed: {e}"
cmdlines = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            pass
marker = spec["host_marker_reversed"][::-1]  # reversed: the probe's own command line must not match
out["host_processes_seen"] = any(marker in c for c in cmdlines)
out["processes_seen"] = len(cmdlines)
out["env"] = sorted(os.environ)
print(json.dumps(out))
'''


class Canary:
    """A listener that counts who connects: a TCP port on 127.0.0.1, or an abstract Unix socket."""

    def __init__(self, abstract: str | None = None):
        if abstract is None:
            self.sock = socket.create_server(("127.0.0.1", 0))
            self.port = self.sock.getsockname()[1]
        else:
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.bind("\0" + abstract)
            self.sock.listen()
        self.hits = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.close()

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from tests.support.servers import tiny_model_dir
    logdir = tmp_path_factory.mktemp("logs")
    with serve(tiny_model_dir(), script=SCRIPT) as srv, capture_proxy(srv.url, logdir) as proxy:
        yield srv, proxy, logdir


def make(runtime: str, tmp_path: Path):
    if runtime == "docker":
        from harness_recipes.docker_engine import docker_client
        from harness_recipes.runtimes.docker import DockerRuntime
        try:
            docker_client()
        except RuntimeError as e:
            pytest.skip(f"dockerd not reachable, the docker runtime is not tested here: {e}")
        return DockerRuntime(memory="1g", cpus=1.0, workdir=str(tmp_path))
    from harness_recipes.runtimes.local import LocalRuntime
    return LocalRuntime(isolation="bwrap" if runtime == "bubblewrap" else "none", workdir=str(tmp_path))


def probe(runtime: str, stack, tmp_path: Path, monkeypatch) -> tuple[dict, dict, str]:
    srv, proxy, logdir = stack
    monkeypatch.setenv("RAY_AUTH_TOKEN", "polar-test-secret-ray-token")  # must never reach a sandbox
    canary, gcs = Canary(), Canary()
    abstract = Canary(abstract=f"polar-canary-{uuid.uuid4().hex}")
    out = tmp_path / "out"
    (out / "rollout").mkdir(parents=True)
    (out / "rollout" / "episodes.jsonl").write_text("{}\n")
    (logdir / "canary.txt").write_text("log")
    eid = f"probe-{runtime}-{uuid.uuid4().hex[:6]}.s0"
    task = Task(id="probe", prompt="p", eval_cmd="true", workspace_dir=FIX_ADD)
    rt = make(runtime, tmp_path)
    marker = f"polar-host-process-{uuid.uuid4().hex}"
    host_proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
    root_secret = next(p for p in (Path("/root/.mitmproxy"), Path("/root/.bashrc")) if p.exists())

    async def go():
        sb = await rt.prepare(task, eid, Path("/usr/bin/python3"), upstream=proxy.url)
        other = await rt.prepare(task, "other.s0", Path("/usr/bin/python3"), upstream=proxy.url)
        try:
            api = sb.api_base(proxy.url)
            spec = {"ports": {"canary": canary.port, "proxy": proxy.port, "server": int(urlsplit(srv.url).port),
                              "ray_gcs": gcs.port},
                    "abstract": abstract_name, "api": api, "api_port": urlsplit(api).port,
                    # what the harness gets: its episode's capability (the proxy has a control secret)
                    "episode": capability(proxy.secret, eid),
                    "header": EPISODE_HEADER, "host_marker_reversed": marker[::-1],
                    "paths": {"checkout": str(ROOT / "pyproject.toml"), "logdir": str(logdir / "canary.txt"),
                              "out": str(out / "rollout" / "episodes.jsonl"),
                              "cache": str(polar_cache("tiny-qwen3")), "other_workspace": f"{other.workspace}/calc.py",
                              "root": str(root_secret), "shadow": "/etc/shadow", "own_workspace": f"{sb.workspace}/calc.py"}}
            argv = sb.harness_argv([sb.python, "-c", PROBE, json.dumps(spec)])
            res = await sb.exec(argv, {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": sb.home}, timeout=120)
            assert res.rc == 0, res.stderr.decode(errors="replace")[-2000:]
            return json.loads(res.stdout.decode().strip().splitlines()[-1]), sb.isolation
        finally:
            await sb.close()
            await other.close()
            await rt.shutdown()

    abstract_name = abstract.sock.getsockname()[1:].decode()
    try:
        found, isolation = asyncio.run(go())
    finally:
        for c in (canary, gcs, abstract):
            c.close()
        host_proc.kill()
        host_proc.wait()
    hits = {"canary": canary.hits, "ray_gcs": gcs.hits, "abstract": abstract.hits}
    found["isolation"] = isolation
    assert asyncio.run(ep.post_end(proxy.url, eid, 1.0, {"isolation": isolation}, secret=proxy.secret)) == ""
    deadline = time.monotonic() + 10
    while True:
        try:
            log = read_episode(logdir / f"{eid}.arrow")
            if log.finished or time.monotonic() > deadline:
                break
        except LogError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.1)
    found["captured"] = [(r["status"], r["error"]) for r in log.calls.iter_rows(named=True)]
    return found, hits, eid


@pytest.mark.parametrize("runtime", ["bubblewrap", "docker"])
def test_the_sandbox_reaches_only_its_model_api(runtime, stack, tmp_path, monkeypatch):
    found, hits, eid = probe(runtime, stack, tmp_path, monkeypatch)
    detail = json.dumps(found, indent=1)
    assert found["isolation"] == runtime
    # The one way out works: a real call through the forwarders and the capture proxy, under the episode.
    assert found["api"][0] == 200 and isinstance(found["api"][1], str), detail
    assert found["captured"] == [(200, None)], detail
    # Nothing else on the host answers: no TCP port on 127.0.0.1, no abstract socket.
    for name in ("canary", "proxy", "server", "ray_gcs", "abstract"):
        assert found["connect"][name].startswith("failed"), f"{name} reachable from the sandbox: {detail}"
    assert hits == {"canary": 0, "ray_gcs": 0, "abstract": 0}, (hits, detail)
    # Through the forwarder nothing but the proxy is reached: a CONNECT or an absolute URL to the canary
    # lands at the reverse proxy (which sends it on to the model server only), never at the canary.
    assert not found["smuggle_connect"].startswith("HTTP/1.1 200 Connection established"), detail
    # Files: the sandbox's own workspace only.
    assert found["read"]["own_workspace"].startswith("read"), detail
    for name in ("checkout", "logdir", "out", "cache", "other_workspace", "root"):
        assert found["read"][name].startswith("failed"), f"{name} readable from the sandbox: {detail}"
    assert found["read"]["shadow"] in ("empty",) or found["read"]["shadow"].startswith("failed"), detail
    assert not found["host_processes_seen"], detail
    assert "RAY_AUTH_TOKEN" not in found["env"], detail


def test_unsandboxed_the_same_probe_finds_the_ways_out(stack, tmp_path, monkeypatch):
    """The control: with --isolation none the probe reaches the canary and reads the checkout, so the
    assertions above can fail. The episode is marked isolation=none."""
    found, hits, _ = probe("none", stack, tmp_path, monkeypatch)
    assert found["isolation"] == "none"
    assert found["connect"]["canary"] == "connected" and hits["canary"] >= 1
    assert found["connect"]["abstract"] == "connected" and found["host_processes_seen"]
    assert found["read"]["checkout"].startswith("read") and found["read"]["other_workspace"].startswith("read")
    assert found["api"][0] == 200 and found["captured"] == [(200, None)]
