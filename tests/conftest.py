"""Project-wide pytest fixtures: the tiny Qwen3 model, a polar-serve factory, and the real vLLM."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

# The suite uses the checkout's .cache/ (the tiny model, the harness CLIs `make harnesses` installed),
# as `make test` does (harness_recipes/cache.py); set before anything reads it, children inherit it.
os.environ.setdefault("POLAR_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))

# Property tests: random examples while developing (they find new cases); in CI the same examples every
# run (Hypothesis's documented CI practice), so a red CI is a reproducible failure, not a draw. A case a
# random run found is pinned with @example where it was fixed.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    _hypothesis_settings.load_profile("ci")

from harness_recipes.cache import vllm_python  # noqa: E402
from harness_recipes.demo.forced_replies import vllm_plugin_args, vllm_plugin_env  # noqa: E402
from harness_recipes.node.local_stack import vllm  # noqa: E402
from tests.support.servers import polar_serve, tiny_model_dir  # noqa: E402

# The name the real vLLM serves the tiny model under in the suite, and the flags it starts with
# (besides local_stack.VLLM_FLAGS, which run it with --logprobs-mode processed_logprobs, so the
# differential and capture suites compare processed logprob values): one server for the whole
# session, so every test that needs flags of its own adds them here rather than starting another
# (40-100 s and 3.2 GB each).
VLLM_MODEL_NAME = "polar-model"
# The ForcedReply logits processor (harness_recipes/demo/forced_replies.py): a no-op for requests without
# `vllm_xargs.polar_forced`, so every other test sees plain vLLM; tests/vllm/test_harness_vllm.py
# scripts the harnesses through it. VLLM_ENV: what vLLM's environment needs to import it.
VLLM_EXTRA_ARGS: list[str] = [*vllm_plugin_args()]
# VLLM_SERVER_DEV_MODE=1: vLLM registers its RL and dev routes only then (/weight_info, /pause,
# /resume, /update_weight_version, /collective_rpc): the proxy reads the served weight version there
# and syncs full weights through them (addon/server_weights.py, tests/vllm/test_weight_sync_vllm.py).
VLLM_ENV: dict[str, str] = {**vllm_plugin_env(), "VLLM_SERVER_DEV_MODE": "1"}


@pytest.fixture(scope="session")
def tiny_model():
    """Path of the tiny random Qwen3 (real tokenizer), built once into .cache/tiny-qwen3/."""
    return tiny_model_dir()


@pytest.fixture(scope="session")
def real_vllm(tiny_model, tmp_path_factory):
    """The real vLLM 0.32 (CPU build, `make vllm`) serving the tiny Qwen3, started once per test
    session (it takes 40-100 s and 3.2 GB) and stopped by pid at the end. `.url` is its base URL."""
    python = vllm_python()
    if not python.exists():
        pytest.skip(f"the real vLLM is not installed at {python}: run `make vllm`")
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm(tiny_model, model_name=VLLM_MODEL_NAME, extra_args=VLLM_EXTRA_ARGS, env=VLLM_ENV, log=log) as p:
        yield p


@pytest.fixture(scope="module")
def stock_vllm(tiny_model, tmp_path_factory):
    """A second real vLLM, started the usual way: vLLM's default logprobs mode (raw_logprobs: the
    model's own log-softmax, before the ForcedReply processor, temperature and truncation), its
    default ``--generation-config auto`` (the tiny Qwen3's generation_config.json: T=0.6, top_k=20,
    top_p=0.95 for fields a request leaves unset), and no VLLM_SERVER_DEV_MODE (so no /weight_info:
    it names no weight version); plugin loaded (a no-op for requests without its field). For the
    modules that need a stock server (tests/vllm/test_harness_vllm.py: forced replies keep the
    model's own logprobs only in raw mode; the logprobs-mode probe; tests/vllm/test_stock_vllm.py).
    Module-scoped: started by the first test of a module that asks for it, stopped by pid after its last."""
    python = vllm_python()
    if not python.exists():
        pytest.skip(f"the real vLLM is not installed at {python}: run `make vllm`")
    log = tmp_path_factory.mktemp("vllm-stock") / "vllm.log"
    with vllm(tiny_model, model_name=VLLM_MODEL_NAME, extra_args=[*VLLM_EXTRA_ARGS, "--logprobs-mode", "raw_logprobs"],
              env=vllm_plugin_env(), log=log) as p:
        yield p


@pytest.fixture
def serve(tiny_model):
    """Factory: `srv = serve("vllm", script=None, extra_args=())` starts polar-serve for this test."""
    with contextlib.ExitStack() as stack:
        def start(dialect="vllm", script=None, extra_args=(), model_dir=None):
            return stack.enter_context(polar_serve(model_dir or tiny_model, dialect, script, extra_args))
        yield start


# Under POLAR_NO_SKIP=1 (CI) a skipped test is a failure: every skip in this suite names a missing
# system piece (chromium, dockerd, a harness CLI), and CI must have them all.
_NO_SKIP = os.environ.get("POLAR_NO_SKIP") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if _NO_SKIP and rep.skipped and not hasattr(rep, "wasxfail"):
        rep.outcome = "failed"
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.longrepr = f"skipped under POLAR_NO_SKIP=1 (CI must run every test): {reason}"
