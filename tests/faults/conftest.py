"""Fixtures for the fault tests: the scripted upstream and mitmdump with the addon in front of it."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

from harness_recipes.node.processes import free_port, running
from tests.addon.procs import mitmdump

SCRIPT = Path(__file__).with_name("scripted_upstream.py")


@contextlib.contextmanager
def scripted(work: Path):
    port = free_port()
    rec = work / f"requests-{port}.jsonl"
    cmd = [sys.executable, str(SCRIPT), "--port", str(port), "--record", str(rec)]
    with running(cmd, log=work / f"upstream-{port}.log", port=port, timeout=30) as p:
        p.record = rec
        yield p


@contextlib.contextmanager
def proxy(work: Path, logdir: Path, upstream: str, **sets):
    with mitmdump(work, logdir, upstream=upstream, sets={"polar_dialect": "vllm", **sets}) as px:
        yield px


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """One scripted upstream and one proxy for the tests that need no special disk."""
    work = tmp_path_factory.mktemp("faults")
    logdir = work / "logs"
    with scripted(work) as up, proxy(work, logdir, up.url) as px:
        yield up, px, logdir
