"""sync_mode=fleet is a mode of the config (the real fleet sync runs in tests/rollout/test_fleet_e2e.py
and, from a training run, tests/rollout/test_fleet_trainer.py); a wrong Ray address fails in seconds."""
from __future__ import annotations

import time

import pytest

from harness_recipes.node.processes import free_port
from trainer.grpo_config import PolarGRPOConfig
from trainer.weight_sync import MODES, WeightSyncError, fleet_sync

pytest.importorskip("ray", reason="sync_mode=fleet needs Ray (pip install 'polar[fleet]')")


def test_fleet_is_a_sync_mode():
    assert "fleet" in MODES
    cfg = PolarGRPOConfig(output_dir="/tmp/x", use_cpu=True, sync_mode="fleet", shards="/tmp/s", max_steps=1)
    assert cfg.sync_mode == "fleet"


def test_a_ray_address_where_nothing_answers_is_a_clear_error_in_seconds(tmp_path):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"cannot join the Ray cluster at sync_server='127.0.0.1:{port}'.*"
                                              r"no Ray cluster answers"):
        fleet_sync(f"127.0.0.1:{port}", str(tmp_path), "1")
    assert time.monotonic() - t0 < 30
