"""`polar-rollout fleet` on a real Ray cluster of two nodes on this machine (``--local 2``:
ray.cluster_utils.Cluster, as Ray's own multi-node tests run), a fast fake harness making real
streamed calls through each node's two real capture proxies to a real polar-serve, everything
landing in one file:// store: every episode's log (only its own calls, complete), its record
naming the node that ran it, and the fleet's shards (one reconstruction over the store's logs)
holding every episode once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from harness_recipes.fleet.store import Store
from polar_contracts.log.reader import read_episode
from tests.support.servers import polar_serve, tiny_model_dir

from .conftest import fake_recipe, write_tasks

ROOT = Path(__file__).resolve().parents[2]
ray = pytest.importorskip("ray", reason="polar-rollout fleet needs Ray (pip install 'polar[fleet]')")

TASKS, SAMPLES, CALLS = 6, 2, 2


def shard_episodes(store) -> list[str]:
    """The episode ids of every row of the fleet's shards (<store>/shards, what the trainer reads),
    sorted, duplicates kept (an episode's rows in two shards would show twice)."""
    out = []
    for f in store.list("shards"):
        if f.endswith(".parquet"):
            rows = pq.read_table(store.path(f"shards/{f}"), columns=["episode_id"]).column("episode_id").to_pylist()
            out += sorted(set(rows))
    return sorted(out)


def test_fleet_of_two_nodes_runs_every_episode_once_into_the_store(tmp_path):
    recipe = fake_recipe(tmp_path, ["chat", str(CALLS), "fix", "calc.py", "return a - b", "return a + b"],
                         name="fleetfake", via="path")
    tasks = write_tasks(tmp_path, n=TASKS)
    store_uri = f"file://{tmp_path}/store"
    with polar_serve(tiny_model_dir(), "vllm") as srv:
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        res = subprocess.run(
            [sys.executable, "-m", "harness_recipes.cli", "fleet", "--recipe", str(recipe), "--tasks", str(tasks),
             "--samples", str(SAMPLES), "--server", srv.base_url, "--store", store_uri, "--local", "2",
             "--proxies-per-node", "2", "--concurrency", "2", "--prewarm", "1", "--isolation", "none",
             "--node-dir", str(tmp_path / "nodes"), "--model", model, "--no-progress"],
            cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"{TASKS * SAMPLES} episodes on 2 nodes" in res.stdout, res.stdout
    store = Store(store_uri)
    recs = store.records()
    eids = sorted(r["episode_id"] for r in recs)
    assert eids == sorted(f"add{t}.s{s}" for t in range(TASKS) for s in range(SAMPLES))  # each once
    assert {r["status"] for r in recs} == {"done"} and {r["reward"] for r in recs} == {1.0}, recs[0]
    nodes = {r["node"] for r in recs}
    assert len(nodes) == 2, nodes  # both nodes took groups from the one queue
    assert all(r["proxies_on_node"] == 2 and r["ray_node_id"].startswith(r["node"][5:]) for r in recs)
    for r in recs:  # a group ran on one node
        assert {x["node"] for x in recs if x["task_id"] == r["task_id"]} == {r["node"]}
    assert store.list("logs") == [f"{e}.arrow" for e in eids]
    for e in eids:
        log = read_episode(Path(store.path(f"logs/{e}.arrow")))
        rows = log.calls.to_dicts()
        assert log.finished and log.reward == 1.0 and len(rows) == CALLS
        # the harness named its episode by its capability (the node's proxies have a control secret),
        # whose mac the proxy scrubs from the log like any credential it knows
        assert all(r["episode_id"] == e and f"episode {e}~[redacted]:" in r["request"] and r["error"] is None
                   for r in rows)
    assert shard_episodes(store) == eids  # every episode in the fleet's shards, once
    summary = json.loads(store.get_bytes("rollout/fleet.json"))
    assert summary["queue"]["finished"] and summary["lost"] == {} and summary["episodes"] == TASKS * SAMPLES


def test_a_weight_sync_reaches_every_proxy_of_every_node_and_the_server_loads_once(tmp_path):
    """The fleet's named coordinator actor (what the trainer's sync_mode=fleet calls) holds the 4 proxies
    of 2 nodes, has one of them load the new weights, releases all: rows name the exact version."""
    import threading

    from harness_recipes.demo.weights import perturbed_copy
    from harness_recipes.fleet.driver import NAMESPACE, WEIGHTS_ACTOR, Cluster, NodeConfig, run_fleet
    from harness_recipes.fleet.queue import plan_groups
    from harness_recipes.tasks.task_file import load_tasks
    from trainer.weight_sync import fleet_sync, fleet_version

    recipe = fake_recipe(tmp_path, ["chat", str(CALLS), "sleep", "0.3"], name="fleetsync", via="path")
    tasks = load_tasks(write_tasks(tmp_path, n=16))
    new = perturbed_copy(tiny_model_dir(), tmp_path / "step-1", scale=0.2)
    store_uri = f"file://{tmp_path}/store"
    store = Store(store_uri)
    with polar_serve(tiny_model_dir(), "vllm") as srv, Cluster(local=2):
        old = httpx.get(srv.base_url + "/polar/weight_version").json()["weight_version"]
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        cfg = NodeConfig(recipe=str(recipe), server=srv.base_url, store=store_uri, proxies=2, model=model,
                         runtime_opts={"isolation": "none"}, node_dir=str(tmp_path / "nodes"),
                         limits={"prewarm": 1, "run": 1, "eval": 1})
        out = {}
        t = threading.Thread(target=lambda: out.update(res=run_fleet(cfg, plan_groups(tasks, 1)[0])))
        t.start()
        deadline = time.monotonic() + 300
        while len(store.list("rollout/records")) < 2:  # the fleet is running on both nodes
            assert t.is_alive() and time.monotonic() < deadline, out
            time.sleep(0.2)
        # what the trainer's sync_mode=fleet calls (this process already joined the cluster)
        sync = fleet_sync("auto", str(new), "1", timeout=300)
        assert fleet_version("auto") == "1"
        info = ray.get(ray.get_actor(WEIGHTS_ACTOR, namespace=NAMESPACE).info.remote(), timeout=60)
        t.join(600)
        served = httpx.get(srv.base_url + "/polar/weight_version").json()["weight_version"]
    res = out["res"]
    assert res.queue["finished"] and not res.lost, res
    assert sync["status"] == 200 and sync["weight_version"] == "1" and sync["error"] is None, sync
    assert len(sync["holds"]) == 3 and {h["status"] for h in sync["holds"]} == {200}  # 2 nodes x 2 proxies - leader
    assert len({h["node"] for h in sync["holds"]}) == 2 and sync["leader"]["status"] == 200
    assert len(info) == 4 and {(i["weight_version"], i["state"]) for i in info} == {("1", "serving")}
    assert served == "1"
    recs = [json.loads(x) for f in (tmp_path / "nodes").glob("*/*/logs/weight-syncs.jsonl")
            for x in f.read_text().splitlines()]
    leader = [r for r in recs if "role" not in r]
    assert len(leader) == 1 and leader[0]["outcome"] == "ok" and [s["step"] for s in leader[0]["steps"]] == ["reload"]
    assert sorted(r.get("role", "") for r in recs if "role" in r) == ["held for a peer's sync"] * 3
    rows = [r for f in store.list("logs") for r in read_episode(Path(store.path(f"logs/{f}"))).calls.to_dicts()]
    assert len(rows) == 16 * CALLS
    after = [r for r in rows if r["t_start"] > leader[0]["t_released"]]
    before = [r for r in rows if r["t_end"] < leader[0]["t_request"]]
    assert after and before
    assert {r["weight_version"] for r in after} == {"1"} and {r["weight_version"] for r in before} == {old}


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaps, as in a container without an init, counts as dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_node_killed_mid_run_loses_no_episode_and_runs_none_twice(tmp_path):
    """Three nodes; one worker node's raylet and rollout actor are SIGKILLed while it runs episodes:
    its proxies die with it; its unfinished samples run again on the others under a new attempt id,
    what it published stays, and every (task, sample) ends with exactly one finished record."""
    import signal
    import threading

    from harness_recipes.fleet.driver import Cluster, NodeConfig, node_name, run_fleet
    from harness_recipes.fleet.queue import plan_groups
    from harness_recipes.tasks.task_file import load_tasks

    recipe = fake_recipe(tmp_path, ["chat", "1", "sleep", "1.5"], name="fleetkill", via="path")
    n_tasks = 12  # enough that the victim has published one and runs another before the others finish
    tasks = load_tasks(write_tasks(tmp_path, n=n_tasks))
    store_uri = f"file://{tmp_path}/store"
    store = Store(store_uri)
    seen: dict[str, dict] = {}
    with polar_serve(tiny_model_dir(), "vllm") as srv, Cluster(local=3) as c:
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        cfg = NodeConfig(recipe=str(recipe), server=srv.base_url, store=store_uri, proxies=1, model=model,
                         runtime_opts={"isolation": "none"}, node_dir=str(tmp_path / "nodes"),
                         limits={"prewarm": 1, "run": 1, "eval": 1})
        out = {}

        def on_stats(stats, queue, wall):
            for s in stats:
                seen[s["node"]] = s

        t = threading.Thread(target=lambda: out.update(res=run_fleet(cfg, plan_groups(tasks, 1)[0], on_stats=on_stats,
                                                                     max_attempts=3)))
        t.start()
        victim = next(iter(c.cluster.worker_nodes))
        vname = "node-" + victim.node_id[:12]
        deadline = time.monotonic() + 300
        # kill it while it runs an episode, after it finished at least one
        while not (seen.get(vname, {}).get("published", 0) >= 1 and seen[vname]["phases"].get("run", 0) >= 1):
            assert t.is_alive() and time.monotonic() < deadline, (out, seen)
            time.sleep(0.1)
        leftover = seen[vname]["proxy_pids"]
        assert leftover and all(alive(p) for p in leftover)
        # the node dies hard: its raylet and the actor's process SIGKILLed at once (an OOM killer, a
        # kill -9 of the node's Ray processes), so neither Ray nor the actor can stop the proxies; the
        # kernel does (PR_SET_PDEATHSIG, die_with_parent.py), though this host lives on
        os.kill(victim.all_processes["raylet"][0].process.pid, signal.SIGKILL)
        os.kill(seen[vname]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while any(alive(p) for p in leftover) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [p for p in leftover if alive(p)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        assert not survivors, f"the dead node's proxies {survivors} outlived it"
        c.cluster.remove_node(victim, allow_graceful=False)  # the rest of its processes
        t.join(600)
    res = out["res"]
    assert list(res.lost) == [vname] and res.queue["finished"] and res.queue["groups"]["done"] == n_tasks, res
    assert node_name({"NodeID": victim.node_id}) == vname
    recs = store.records()
    finished = {}
    for r in recs:
        assert r["status"] == "done", r
        key = (r["task_id"], r["sample"])
        assert key not in finished, f"{key} finished twice: {finished.get(key)} and {r['episode_id']}"
        finished[key] = r["episode_id"]
    assert len(finished) == n_tasks  # none lost
    retried = [r for r in recs if r["attempt"] > 0]
    assert retried and all(r["node"] != vname and r["episode_id"].endswith(f".a{r['attempt']}") for r in retried)
    assert any(r["node"] == vname for r in recs)  # what it published before it died stays
    assert store.list("logs") == sorted(f"{e}.arrow" for e in finished.values())
    assert shard_episodes(store) == sorted(finished.values())  # no episode lost, none twice


def test_a_node_declared_lost_while_alive_is_fenced_and_publishes_nothing_stale(tmp_path):
    """The queue declares a live node lost (as the driver does when Ray reports its actor dead but
    the process runs on: a partition, a raylet gone under a live worker): its groups run again
    elsewhere under the next attempt, and the zombie's late episodes are refused at the queue, which
    alone moves logs into the store (TaskQueue.publish): no stale log, record or shard row."""
    import threading

    from harness_recipes.fleet.driver import NAMESPACE, QUEUE_ACTOR, Cluster, NodeConfig, run_fleet
    from harness_recipes.fleet.queue import plan_groups
    from harness_recipes.tasks.task_file import load_tasks

    recipe = fake_recipe(tmp_path, ["chat", "1", "sleep", "1.5"], name="fleetzombie", via="path")
    n_tasks = 6
    tasks = load_tasks(write_tasks(tmp_path, n=n_tasks))
    store_uri = f"file://{tmp_path}/store"
    store = Store(store_uri)
    seen: dict[str, dict] = {}
    with polar_serve(tiny_model_dir(), "vllm") as srv, Cluster(local=2):
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        cfg = NodeConfig(recipe=str(recipe), server=srv.base_url, store=store_uri, proxies=1, model=model,
                         runtime_opts={"isolation": "none"}, node_dir=str(tmp_path / "nodes"),
                         limits={"prewarm": 1, "run": 1, "eval": 1})
        out = {}

        def on_stats(stats, queue, wall):
            for s in stats:
                seen[s["node"]] = s

        t = threading.Thread(target=lambda: out.update(res=run_fleet(cfg, plan_groups(tasks, 1)[0], on_stats=on_stats)))
        t.start()
        deadline = time.monotonic() + 300
        while not (zombie := next((n for n, s in seen.items() if s["published"] >= 1 and s["phases"].get("run", 0)),
                                  None)):
            assert t.is_alive() and time.monotonic() < deadline, (out, seen)
            time.sleep(0.1)
        queue = ray.get_actor(QUEUE_ACTOR, namespace=NAMESPACE)
        requeued = ray.get(queue.node_lost.remote(zombie, []))
        before = {r["episode_id"] for r in store.records()}
        t.join(600)
    res = out["res"]
    assert list(res.lost) == [zombie] and res.lost[zombie].startswith("fenced: "), res.lost
    assert res.queue["finished"] and res.queue["groups"]["done"] == n_tasks and res.queue["lost"] == [zombie], res
    refused = res.queue["refused"]
    assert refused and {r["node"] for r in refused} == {zombie}, refused  # the zombie did try, and was refused
    assert all("was declared lost" in r["why"] for r in refused)
    recs = store.records()
    finished = {}
    for r in recs:
        key = (r["task_id"], r["sample"])
        assert key not in finished, f"{key} twice: {finished[key]} and {r['episode_id']}"
        finished[key] = r["episode_id"]
    assert len(finished) == n_tasks and {r["status"] for r in recs} == {"done"}
    assert {r["episode_id"] for r in recs if r["node"] == zombie} <= before  # nothing of it after it was fenced
    assert not {r["episode_id"] for r in refused} & set(finished.values())
    for key in requeued:  # its groups ran again elsewhere, under attempt 1
        [r] = [r for r in recs if r["task_id"] == key]
        assert r["attempt"] == 1 and r["node"] != zombie and r["episode_id"].endswith(".a1"), r
    assert store.list("logs") == sorted(f"{e}.arrow" for e in finished.values())
    assert store.list("staging") == []  # the refused logs were removed, the published ones moved
    assert shard_episodes(store) == sorted(finished.values())
