"""`polar-rollout fleet`'s input checks (before any Ray node starts) and its plain progress lines."""
from __future__ import annotations

import io
import os

from rich.console import Console

from harness_recipes.fleet.store import Store
from harness_recipes.node.progress import FleetView

from .conftest import write_tasks
from .test_cli import cli


def fleet_args(tmp_path, store, *extra):
    return ["fleet", "--recipe", "pi", "--tasks", str(write_tasks(tmp_path)), "--server", "http://127.0.0.1:9",
            "--store", store, "--no-progress", *extra]


def test_fleet_input_errors_name_the_problem(tmp_path):
    store = f"file://{tmp_path}/store"
    res = cli(*fleet_args(tmp_path, store))
    assert res.returncode == 2 and "give exactly one of --ray-address" in res.stderr
    res = cli(*fleet_args(tmp_path, store, "--local", "2", "--ray-address", "auto"))
    assert res.returncode == 2 and "give exactly one of --ray-address" in res.stderr
    res = cli(*fleet_args(tmp_path, "nosuchscheme://x", "--local", "1"))
    assert res.returncode == 2 and "not a filesystem URI" in res.stderr
    Store(store).put_json("rollout/records/add0.s0.json", {"task_id": "add0", "sample": 0, "attempt": 0,
                                                            "status": "done"})
    res = cli(*fleet_args(tmp_path, store, "--local", "1"))
    assert res.returncode == 2 and "already holds 1 rollout records: pass --resume" in res.stderr
    res = cli(*fleet_args(tmp_path, store, "--local", "1", "--resume"))  # nothing left: no Ray started
    assert res.returncode == 0 and "nothing left to run" in res.stdout, res.stderr
    assert "1 episodes finished before, skipped" in res.stderr


def test_fleet_view_plain_lines_name_each_node():
    buf = io.StringIO()
    view = FleetView(enabled=False, every_s=0)
    view.console = Console(file=buf, width=300)
    with view:
        view.update([{"node": "node-a", "finished": 3, "phases": {"run": 2}, "note": "running"},
                     {"node": "node-b", "error": "ActorDiedError: ..."}],
                    {"finished": False, "groups": {"queued": 1}}, 2.0)
    line = buf.getvalue()
    assert "3 episodes, 1.50/s" in line and "node-a: 3 done, 2 running (running)" in line
    assert "node-b: 0 done, 0 running (lost)" in line


def test_fleet_takes_swebench_instances_with_their_filters(tmp_path):
    import json
    from pathlib import Path
    mini = Path(__file__).resolve().parents[2] / "data" / "swebench" / "mini.jsonl"
    first = json.loads(mini.read_text().splitlines()[0])["instance_id"]
    store = f"file://{tmp_path}/store"
    base = ["fleet", "--recipe", "pi", "--tasks", f"swebench:{mini}", "--server", "http://127.0.0.1:9",
            "--store", store, "--no-progress", "--local", "1"]
    res = cli(*base, "--instances", "nope")
    assert res.returncode == 2 and "--instances: not in" in res.stderr and "nope" in res.stderr
    res = cli(*base, "--limit", "1")
    assert res.returncode == 2 and "add --runtime docker" in res.stderr
    # --limit 1 keeps only the first instance: with its one episode recorded, nothing is left to run
    Store(store).put_json(f"rollout/records/{first}.s0.json", {"task_id": first, "sample": 0, "attempt": 0,
                                                               "status": "done"})
    res = cli(*base, "--limit", "1", "--runtime", "docker", "--resume")
    assert res.returncode == 0 and "nothing left to run" in res.stdout, res.stderr


def test_a_ray_address_where_nothing_answers_fails_in_seconds(tmp_path):
    """ray.init alone retries a dead address for minutes; the fleet probes the head's port first."""
    import time

    from harness_recipes.node.processes import free_port

    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    res = cli(*fleet_args(tmp_path, f"file://{tmp_path}/store", "--ray-address", f"127.0.0.1:{port}"))
    assert res.returncode == 1 and "--ray-address: no Ray cluster answers at" in res.stderr, res.stderr[-2000:]
    assert f":{port}" in res.stderr and time.monotonic() - t0 < 30
    # "auto" resolves as Ray does (RAY_ADDRESS first), then the same probe
    res = cli(*fleet_args(tmp_path, f"file://{tmp_path}/store", "--ray-address", "auto"),
              env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"})
    assert res.returncode == 1 and "no Ray cluster answers at" in res.stderr, res.stderr[-2000:]
