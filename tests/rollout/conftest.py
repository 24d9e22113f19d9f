"""Fixtures for the rollout tests: a fake end-point server, a fake-harness recipe, task files."""
from __future__ import annotations

import json
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_harness.py"


class EndServer:
    """A tiny HTTP server that answers POST /polar/<ep>/end like an open proxy's addon and remembers
    each end (and GET /polar/@control: open)."""

    def __init__(self):
        self.ends: dict[str, dict] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # GET /polar/@control as an open proxy answers it (tests opt in to it)
                ok = self.path == "/polar/@control"
                body = b'{"control":"open"}' if ok else b""
                self.send_response(200 if ok else 404)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                parts = self.path.strip("/").split("/")
                if len(parts) == 3 and parts[0] == "polar" and parts[2] == "end":
                    outer.ends[parts[1]] = body
                    self.send_response(200)
                else:
                    self.send_response(404)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def end_server():
    s = EndServer()
    yield s
    s.close()


def fake_harness_installed(tmp_path: Path, monkeypatch, argv: list[str]) -> tuple[Path, Path]:
    """(recipe path, exe) for the fake harness installed the way a recipe's CLI is, in its own prefix
    <harness cache>/fake/: sandboxes bind only the recipe's own install prefix (runtimes/), so the
    script and the interpreter the harness runs by (a link to the system python3, which containers
    see under /usr) both live there."""
    cache = tmp_path / "cache"
    prefix = cache / "fake"
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    script = prefix / "fake_harness.py"
    shutil.copy(FAKE, script)
    exe = prefix / "bin" / "python3"
    if not exe.is_symlink():
        exe.symlink_to("/usr/bin/python3")
    monkeypatch.setenv("POLAR_HARNESS_CACHE", str(cache))
    recipe_path = fake_recipe(tmp_path, argv)
    recipe_path.write_text(recipe_path.read_text().replace(str(FAKE), str(script))
                           .replace(f'bin = "{sys.executable}"', f'bin = "{exe}"'))
    return recipe_path, exe


def fake_recipe_text(argv: list[str], name: str = "fake", via: str = "header") -> str:
    """fake_harness.toml filled in: the harness is fake_harness.py run by this Python, argv after the script path."""
    args = ", ".join(json.dumps(a) for a in [str(FAKE), *argv])
    return ((HERE / "fake_harness.toml").read_text().replace("@NAME@", name).replace("@BIN@", sys.executable)
            .replace("@VIA@", via).replace("@ARGV@", args))


def fake_recipe(tmp_path: Path, argv: list[str], name: str = "fake", via: str = "header") -> Path:
    """A recipe whose harness is fake_harness.py run by this Python; argv follows the script path.
    ``via``: how the harness names its episode to the proxy (path: FAKE_BASE is /polar/<id>)."""
    p = tmp_path / f"{name}.toml"
    p.write_text(fake_recipe_text(argv, name, via))
    return p


def write_tasks(tmp_path: Path, timeout: float = 30, n: int = 1) -> Path:
    """n copies of the fix-add task with the repo from data/tasks."""
    repo = HERE.parent.parent / "data" / "tasks" / "repos" / "fix_add"
    lines = [json.dumps({"id": f"add{i}", "workspace": str(repo), "prompt": "fix calc.py",
                         "eval": "git checkout -q HEAD -- test_calc.py && python3 -m unittest -q test_calc",
                         "timeout": timeout, "eval_timeout": 30}) for i in range(n)]
    p = tmp_path / "tasks.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.fixture(scope="module")
def docker_runtime_cls():
    """The docker runtime class, once a Docker engine answers (`make test` starts a quiet dockerd:
    .ci/with-dockerd.sh); else the test is skipped saying why (a failure under POLAR_NO_SKIP=1)."""
    try:
        from harness_recipes.docker_engine import docker_client
        from harness_recipes.runtimes.docker import DockerRuntime
        docker_client()
    except RuntimeError as e:
        pytest.skip(f"dockerd not reachable, the docker runtime is not tested here: {e}")
    return DockerRuntime
