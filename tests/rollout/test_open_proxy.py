"""`polar-rollout run` against a proxy whose control plane is open (docs/security.md): refused up front with
how to secure it, unless --unsafe-open-proxy, which marks every episode (end metadata, then the
shard column control_plane). Real mitmdump with the addon; the fake harness of conftest.py."""
from __future__ import annotations

import json

import httpx
import pytest

from harness_recipes.node.local_stack import capture_proxy, control_secret_file
from harness_recipes.node.proxy_control import ProxyControlError, decide
from polar_contracts.control import CONTROL_HEADER, STATUS_PATH
from polar_contracts.log.arrays import read_head

from .conftest import fake_recipe, write_tasks
from .test_cli import cli

# The upstream: any live HTTP server (mitmproxy connects to it with each client connection; the
# fake harness makes no model call): conftest's end_server.


def run_args(tmp_path, recipe, tasks, proxy, *extra):
    return ["run", "--recipe", str(recipe), "--tasks", str(tasks), "--proxy", proxy, "--logdir", str(tmp_path / "logs"),
            "--out", str(tmp_path / "out"), "--no-progress", "--recon", "none", "--isolation", "none", *extra]


def records(tmp_path) -> list[dict]:
    p = tmp_path / "out" / "rollout" / "episodes.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def test_the_proxy_says_whether_its_control_plane_is_secured(tmp_path, end_server):
    with capture_proxy(end_server.url, tmp_path / "l1", control_secret=None) as px:
        r = httpx.get(px.url + STATUS_PATH)
        assert r.status_code == 200 and r.json() == {"control": "open"}
        assert httpx.post(px.url + STATUS_PATH).status_code == 405
    with capture_proxy(end_server.url, tmp_path / "l2") as px:
        assert httpx.get(px.url + STATUS_PATH).status_code == 403  # (the agent learns no more than that)
        assert httpx.get(px.url + STATUS_PATH, headers={CONTROL_HEADER: "x" * 43}).status_code == 403
        r = httpx.get(px.url + STATUS_PATH, headers={CONTROL_HEADER: px.secret})
        assert r.status_code == 200 and r.json() == {"control": "secured"}


def test_run_refuses_an_open_proxy_and_says_how_to_secure_it(tmp_path, end_server):
    fix = fake_recipe(tmp_path, ["fix", "calc.py", "return a - b", "return a + b"], name="fix")
    tasks = write_tasks(tmp_path)
    with capture_proxy(end_server.url, tmp_path / "logs", control_secret=None) as px:
        res = cli(*run_args(tmp_path, fix, tasks, px.url))
        assert res.returncode == 1, res.stderr
        assert "OPEN control plane" in res.stderr and "polar_control_secret_file" in res.stderr
        assert "--control-secret-file" in res.stderr and "--unsafe-open-proxy" in res.stderr
        assert records(tmp_path) == [] and not list((tmp_path / "logs").glob("*.arrow"))  # nothing ran
        # the explicit opt-in runs, and the episode says so on its end record (then every row)
        res = cli(*run_args(tmp_path, fix, tasks, px.url, "--unsafe-open-proxy"))
        assert res.returncode == 0, res.stderr
        assert "control plane is OPEN" in res.stderr
    (rec,) = records(tmp_path)
    assert rec["status"] == "done" and rec["reward"] == 1.0
    head = read_head(tmp_path / "logs" / f"{rec['episode_id']}.arrow")
    assert head.metadata["control_plane"] == "open"


def test_run_needs_the_proxys_own_secret(tmp_path, end_server):
    fix = fake_recipe(tmp_path, ["fix", "calc.py", "return a - b", "return a + b"], name="fix")
    tasks = write_tasks(tmp_path)
    with capture_proxy(end_server.url, tmp_path / "logs") as px, control_secret_file() as (_, other):
        res = cli(*run_args(tmp_path, fix, tasks, px.url))
        assert res.returncode == 1 and "holds a control secret: pass --control-secret-file" in res.stderr, res.stderr
        res = cli(*run_args(tmp_path, fix, tasks, px.url, "--control-secret-file", str(other)))
        assert res.returncode == 1 and "refused this node's control secret" in res.stderr, res.stderr
        assert records(tmp_path) == []
        res = cli(*run_args(tmp_path, fix, tasks, px.url, "--control-secret-file", str(px.secret_file)))
        assert res.returncode == 0, res.stderr
    (rec,) = records(tmp_path)
    assert rec["status"] == "done" and rec["reward"] == 1.0
    assert read_head(tmp_path / "logs" / f"{rec['episode_id']}.arrow").metadata["control_plane"] == "secured"


@pytest.mark.parametrize("status,body,secret,allow,want", [
    (200, b'{"control":"open"}', False, False, "OPEN control plane"),
    (200, b'{"control":"open"}', True, False, "OPEN control plane"),  # (our secret is ignored there)
    (200, b'{"control":"open"}', False, True, "open"),
    (200, b'{"control":"secured"}', True, False, "secured"),
    (403, b"{}", False, False, "holds a control secret"),
    (403, b"{}", True, True, "refused this node's control secret"),
    (404, b"not found", False, True, "did not answer GET /polar/@control"),
    (200, b'{"control":"maybe"}', False, True, "did not answer GET /polar/@control"),
])
def test_decide(status, body, secret, allow, want):
    if want in ("open", "secured"):
        assert decide("http://p", status, body, secret, allow) == want
    else:
        with pytest.raises(ProxyControlError, match=want):
            decide("http://p", status, body, secret, allow)
