"""The fleet's recon on a store recon cannot open in place (fleet_recon.MirroredRecon): a shard that
reached the store without the manifest naming it (the driver killed between the two uploads) is
adopted on resume, never built twice. The store here is file://, driven through the same Store calls
an s3:// store gets (tests/rollout/test_fleet_s3.py runs the whole fleet on moto's S3 server)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import polars as pl

from harness_recipes.fleet.recon import MirroredRecon
from harness_recipes.fleet.store import LOGS, SHARDS, Store
from polar_contracts.shards import MANIFEST
from polar_recon import testing as L


def simple(c):
    c.call(L.Sample("Write it.", "", [L.write_tool()]), results=["ok"])
    c.call(L.Sample("", "Done.", []))


def test_a_shard_uploaded_before_its_manifest_is_adopted_not_built_again(tmp_path):
    store = Store(f"file://{tmp_path}/store")
    logs = tmp_path / "store" / LOGS
    first = tmp_path / "first-logs"
    for d in (logs, first):
        d.mkdir(parents=True)
    for k, eid in enumerate(("a0", "a1", "b0", "b1")):
        L.episode(logs, eid, simple, metadata={"group_id": eid[0]}, harness="tidy", seed=k)
    for eid in ("a0", "a1"):
        shutil.copy(logs / f"{eid}.arrow", first / f"{eid}.arrow")
    # the killed driver's last upload: group a's shard in the store, the manifest never uploaded
    built = tmp_path / "built"
    subprocess.run([sys.executable, "-m", "polar_recon.cli", "build", str(first), str(built)], check=True,
                   capture_output=True)
    (tmp_path / "store" / SHARDS).mkdir()
    shutil.copy(built / "shard-000000.parquet", tmp_path / "store" / SHARDS / "shard-000000.parquet")
    assert not (tmp_path / "store" / SHARDS / MANIFEST).exists()
    orphan = (built / "shard-000000.parquet").read_bytes()

    recon = MirroredRecon(store, group_size=2, workdir=tmp_path / "mirror", poll_s=0.1)
    recon.start()
    res = recon.finish()
    assert res["built"] and not res["sync_errors"], res
    shards = sorted((tmp_path / "store" / SHARDS).glob("shard-*.parquet"))
    eids = pl.concat([pl.read_parquet(p, columns=["episode_id"]) for p in shards])["episode_id"].to_list()
    assert sorted(eids) == ["a0", "a1", "b0", "b1"], eids  # each once: group a adopted, group b built
    # adopted, not rebuilt under the same name: a trainer that read the orphan shard-000000 already
    # must never find other episodes under that name (it would skip them, and see group a again)
    assert (tmp_path / "store" / SHARDS / "shard-000000.parquet").read_bytes() == orphan
    manifest = json.loads((tmp_path / "store" / SHARDS / MANIFEST).read_text())
    assert {e: v["shard"] for e, v in manifest["episodes"].items()} == {"a0": 0, "a1": 0, "b0": 1, "b1": 1}
