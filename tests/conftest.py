"""Project-wide pytest fixtures: the tiny Qwen3 model and a polar-serve factory."""
from __future__ import annotations

import contextlib

import pytest

from tests.support.servers import polar_serve, tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model():
    """Path of the tiny random Qwen3 (real tokenizer), built once into .cache/tiny-qwen3/."""
    return tiny_model_dir()


@pytest.fixture
def serve(tiny_model):
    """Factory: `srv = serve("vllm", script=None, extra_args=())` starts polar-serve for this test."""
    with contextlib.ExitStack() as stack:
        def start(dialect="vllm", script=None, extra_args=(), model_dir=None):
            return stack.enter_context(polar_serve(model_dir or tiny_model, dialect, script, extra_args))
        yield start
