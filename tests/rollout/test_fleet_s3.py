"""A fleet whose store is S3 (an S3-compatible server on loopback: moto's server mode, a real HTTP
S3 API): the nodes publish logs and records as objects, the fleet's recon mirrors the logs to a
local directory, builds there and uploads the shards (fleet_recon.MirroredRecon), and the trainer's
ShardSource reads its groups from ``s3://.../shards``. A resumed fleet's recon starts from the
store's shards and manifest: nothing is built twice."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from harness_recipes.fleet.store import Store
from harness_recipes.node.processes import free_port, running, venv_bin
from tests.support.servers import polar_serve, tiny_model_dir

from .conftest import fake_recipe, write_tasks

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("ray", reason="polar-rollout fleet needs Ray (pip install 'polar[fleet]')")
pytest.importorskip("moto.server", reason="the S3 store test needs moto[server] (pip install 'polar[test]')")

CREDS = {"AWS_ACCESS_KEY_ID": "polar-test", "AWS_SECRET_ACCESS_KEY": "polar-test", "AWS_DEFAULT_REGION": "us-east-1",
         "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture()
def s3(monkeypatch):
    """moto's S3 server on 127.0.0.1 with a bucket; yields the endpoint (host:port)."""
    for k, v in CREDS.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    with running([venv_bin("moto_server"), "-H", "127.0.0.1", "-p", str(port)], port=port, timeout=60) as p:
        endpoint = f"127.0.0.1:{port}"
        import pyarrow.fs as pafs
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
        fs.create_dir("polar")
        yield endpoint
        assert p.proc.poll() is None


def shard_rows(store: Store) -> list[str]:
    out = []
    for f in store.list("shards"):
        if f.endswith(".parquet"):
            with store.fs.open_input_file(store.path(f"shards/{f}")) as fh:
                out += sorted(set(pq.read_table(fh, columns=["episode_id"]).column("episode_id").to_pylist()))
    return sorted(out)


def fleet(tmp_path, recipe, tasks, srv, store_uri, model, *extra):
    return subprocess.run(
        [sys.executable, "-m", "harness_recipes.cli", "fleet", "--recipe", str(recipe), "--tasks", str(tasks),
         "--samples", "2", "--server", srv.base_url, "--store", store_uri, "--local", "1", "--proxies-per-node", "1",
         "--concurrency", "2", "--prewarm", "1", "--isolation", "none", "--node-dir", str(tmp_path / "nodes"),
         "--model", model, "--no-progress", *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ))


def test_a_fleet_on_an_s3_store_shards_every_episode_once_and_the_trainer_reads_them(tmp_path, s3):
    from trainer.shard_source import ShardSource

    recipe = fake_recipe(tmp_path, ["chat", "1", "fix", "calc.py", "return a - b", "return a + b"],
                         name="fleets3", via="path")
    store_uri = f"s3://polar/run?endpoint_override={s3}&scheme=http"
    with polar_serve(tiny_model_dir(), "vllm") as srv:
        model = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        res = fleet(tmp_path, recipe, write_tasks(tmp_path, n=3), srv, store_uri, model)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert "6 episodes on 1 nodes" in res.stdout and "shards in s3://polar/run/shards" in res.stdout, res.stdout
        store = Store(store_uri)
        eids = sorted(f"add{t}.s{s}" for t in range(3) for s in range(2))
        assert sorted(r["episode_id"] for r in store.records()) == eids
        assert store.list("logs") == [f"{e}.arrow" for e in eids] and store.list("staging") == []
        assert shard_rows(store) == eids  # every episode in the uploaded shards, once
        assert store.get_bytes("shards/.polar-recon-manifest.json")  # the manifest went up too

        # the trainer's source reads the groups from S3 (pyarrow's S3 filesystem, the same URI scheme)
        src = ShardSource(f"s3://polar/run/shards?endpoint_override={s3}&scheme=http", poll_interval=0.1)
        groups = [src.next_group(timeout=30) for _ in range(3)]
        assert sorted(e for g in groups for e in {r["episode_id"] for r in g.rows}) == eids

        # a resumed fleet with more tasks: its recon starts from the store's shards, builds only the new
        res = fleet(tmp_path, recipe, write_tasks(tmp_path, n=4), srv, store_uri, model, "--resume")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert "6 episodes finished before, skipped" in res.stderr and "2 episodes on 1 nodes" in res.stdout
    assert shard_rows(store) == sorted(eids + ["add3.s0", "add3.s1"])  # none twice
