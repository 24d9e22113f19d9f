"""The trainer consumes the fleet's store while the fleet runs: the trainer is independent of it.

A real Ray cluster of two nodes on this machine, each with two real capture proxies in front of a
real polar-serve, a fast fake harness; the real `trainer/train_grpo.py` (PolarGRPOTrainer, TRL) in
its own process with ``--shards file://<store>/shards`` and ``--sync_mode fleet``: it trains on
groups as the fleet's one reconstruction lands them, and after each step its weights reach every
proxy of both nodes through the fleet's coordinator (the server loads them once per sync). The
fleet does not wait for the trainer (it runs every episode; the trainer takes only two groups and
leaves) and the trainer does not wait for the fleet to finish (it steps and syncs while the fleet
is still running episodes, which then carry the trainer's versions)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness_recipes.fleet.store import Store
from polar_contracts.log.reader import read_episode
from tests.support.servers import polar_serve, tiny_model_dir

from .conftest import fake_recipe, write_tasks
from .test_fleet_e2e import shard_episodes

ROOT = Path(__file__).resolve().parents[2]
ray = pytest.importorskip("ray", reason="polar-rollout fleet needs Ray (pip install 'polar[fleet]')")

TASKS, SAMPLES, STEPS = 14, 2, 2


def test_the_trainer_steps_and_syncs_every_node_while_the_fleet_runs(tmp_path):
    from harness_recipes.fleet.driver import Cluster, NodeConfig, run_fleet
    from harness_recipes.fleet.queue import plan_groups
    from harness_recipes.tasks.task_file import load_tasks

    # two calls and a short think per episode: the fleet runs ~25 s, long enough for the trainer's steps
    recipe = fake_recipe(tmp_path, ["chat", "2", "sleep", "2"], name="fleettrain", via="path")
    tasks = load_tasks(write_tasks(tmp_path, n=TASKS))
    store_uri = f"file://{tmp_path}/store"
    store = Store(store_uri)
    with polar_serve(tiny_model_dir(), "vllm") as srv, Cluster(local=2) as c:
        old = httpx.get(srv.base_url + "/polar/weight_version").json()["weight_version"]
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        # the trainer first: it joins the cluster and waits for shards (another process, as on another machine)
        trainer = subprocess.Popen(
            [sys.executable, "-m", "trainer.train_grpo", "--shards", f"{store_uri}/shards",
             "--model", str(tiny_model_dir()), "--output_dir", str(tmp_path / "ckpt"), "--max_steps", str(STEPS),
             "--num_generations", str(SAMPLES), "--per_device_train_batch_size", str(2 * SAMPLES),  # (an episode: 2 segments)
             "--sync_mode", "fleet", "--sync_server", c.cluster.address, "--sync_steps", "1",
             "--temperature", "1.0", "--learning_rate", "1e-5", "--use_cpu", "--bf16", "false",
             "--gradient_checkpointing", "false", "--report_to", "none", "--save_strategy", "no",
             "--shard_wait_timeout", "120", "--shard_poll_interval", "0.2", "--disable_tqdm", "true",
             "--logging_steps", "1", "--torch_threads", "1",
             # the fake harness sets only the temperature: the proxy cannot tell which top_k/top_p the
             # server applied, so the IS correction would exclude every row (the trainer's rule)
             "--vllm_importance_sampling_correction", "false"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        cfg = NodeConfig(recipe=str(recipe), server=srv.base_url, store=store_uri, proxies=2, model=model,
                         runtime_opts={"isolation": "none"}, node_dir=str(tmp_path / "nodes"), samples=SAMPLES,
                         limits={"prewarm": 1, "run": 2, "eval": 1})
        out: dict = {}
        fleet = threading.Thread(target=lambda: out.update(res=run_fleet(cfg, plan_groups(tasks, SAMPLES)[0])))
        fleet.start()
        try:
            trainer_out, _ = trainer.communicate(timeout=600)
        finally:
            if trainer.poll() is None:
                trainer.kill()
        t_trainer_done = time.time()
        fleet.join(600)
        served = httpx.get(srv.base_url + "/polar/weight_version").json()["weight_version"]
    assert trainer.returncode == 0, trainer_out[-5000:]
    res = out["res"]
    assert res.queue["finished"] and not res.lost and res.episodes == TASKS * SAMPLES, res

    # every episode once, in the records and the shards, whatever the trainer did
    recs = store.records()
    eids = sorted(r["episode_id"] for r in recs)
    assert eids == sorted(f"add{t}.s{s}" for t in range(TASKS) for s in range(SAMPLES))
    assert len({r["node"] for r in recs}) == 2 and shard_episodes(store) == eids

    # the trainer's syncs: each held every proxy of both nodes, the server loaded once per step
    syncs = [json.loads(x) for f in sorted((tmp_path / "nodes").glob("*/*/logs/weight-syncs.jsonl"))
             for x in f.read_text().splitlines()]
    leads = sorted((s for s in syncs if "role" not in s), key=lambda s: s["t_request"])
    assert [(s["weight_version"], s["outcome"]) for s in leads] == [(f"step-{i:06d}", "ok") for i in range(1, STEPS + 1)]
    assert all([st["step"] for st in s["steps"]] == ["reload"] for s in leads)
    held = [s for s in syncs if s.get("role") == "held for a peer's sync"]
    assert len(held) == STEPS * (2 * 2 - 1)  # 2 nodes x 2 proxies, less the leader, per sync
    assert served == f"step-{STEPS:06d}"

    # the trainer did not wait for the fleet to finish: episodes ran after its syncs, on both nodes'
    # proxies, and carry its versions; the rows before the first sync carry the server's first version
    rows = [(r, rec["node"]) for rec in recs for r in read_episode(Path(rec["log"])).calls.to_dicts()]
    last = leads[-1]
    after = [(r, n) for r, n in rows if r["t_start"] > last["t_released"]]
    assert after, "no episode ran after the trainer's last sync: the fleet waited or ended first"
    assert {r["weight_version"] for r, _ in after} == {f"step-{STEPS:06d}"}
    assert {r["weight_version"] for r, _ in rows if r["t_end"] < leads[0]["t_request"]} == {old}
    # the fleet did not wait for the trainer: it ran all its groups though the trainer took STEPS and left
    assert TASKS > STEPS and t_trainer_done > 0
