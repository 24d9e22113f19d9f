from __future__ import annotations

import os

import pytest
import torch

# 2 cores shared by several engineers: keep torch to one thread, and keep TRL's rollout_func
# "experimental" warning out of the output.
torch.set_num_threads(1)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_dir():
    from tests.support.servers import tiny_model_dir

    return tiny_model_dir()


@pytest.fixture(scope="session")
def sampler(tiny_dir):
    from tests.trainer.shardkit import Sampler

    return Sampler(tiny_dir, seed=0)
