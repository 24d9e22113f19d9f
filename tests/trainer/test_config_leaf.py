"""trainer/grpo_config.py is a leaf of the trainer package: it validates its fields from
trainer/config_choices.py alone, and the modules that act on those values use the same constants."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_grpo_config_imports_no_other_trainer_module():
    code = ("import sys, trainer.grpo_config; "
            "print(sorted(m for m in sys.modules if m.startswith('trainer.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['trainer.config_choices', 'trainer.cpu_fallback', 'trainer.grpo_config']"


def test_public_names_are_the_shared_constants():
    from trainer import config_choices, is_correction, shard_rollout, weight_sync

    assert shard_rollout.POLICIES is config_choices.GROUP_SIZE_POLICIES == ("pad", "skip")
    assert is_correction.MODES is config_choices.IS_MODES
    assert weight_sync.MODES is config_choices.SYNC_MODES
