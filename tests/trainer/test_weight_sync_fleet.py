"""sync_mode=fleet is a mode of the config (the real fleet sync runs in tests/rollout/test_fleet_e2e.py).
(Not tested here: joining an address where no Ray cluster runs: ray.init retries for minutes.)"""
from __future__ import annotations

from trainer.grpo import PolarGRPOConfig
from trainer.weight_sync import MODES


def test_fleet_is_a_sync_mode():
    assert "fleet" in MODES
    cfg = PolarGRPOConfig(output_dir="/tmp/x", use_cpu=True, sync_mode="fleet", shards="/tmp/s", max_steps=1)
    assert cfg.sync_mode == "fleet"
