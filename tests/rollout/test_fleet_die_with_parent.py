"""A fleet node's proxies die with the node's actor process (die_with_parent.py, PR_SET_PDEATHSIG):
real processes, the parent SIGKILLed so no cleanup of its own runs. (The fleet's own case, a node's
raylet killed under its actor, is in test_fleet_e2e.py.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness_recipes.node.die_with_parent import command

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def alive(pid: int) -> bool:
    """Running (a zombie, waiting for a reaper that may never come in a container, counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def parent_with_child(cmd: str) -> tuple[subprocess.Popen, int]:
    """A Python parent that starts ``cmd`` (an expression) and sleeps; (parent, the child's pid)."""
    code = ("import subprocess, sys, time\n"
            "from harness_recipes.node.die_with_parent import command\n"
            f"p = subprocess.Popen({cmd})\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return parent, int(parent.stdout.readline())


def wait_dead(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def test_the_child_dies_when_its_parent_is_killed():
    parent, child = parent_with_child("command(['sleep', '600'])")
    try:
        time.sleep(0.5)  # the wrapper has exec'd sleep: the child's pid is sleep's
        assert alive(child) and Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
        parent.kill()
        parent.wait()
        assert wait_dead(child, 5), "the child outlived its parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_without_the_wrapper_the_child_outlives_its_parent():
    """The control: the same parent and child, no wrapper: the child lives on (so the test above can fail)."""
    parent, child = parent_with_child("['sleep', '600']")
    try:
        parent.kill()
        parent.wait()
        assert not wait_dead(child, 1.5)
    finally:
        os.kill(child, signal.SIGKILL)


def test_a_parent_gone_before_the_wrapper_ran_stops_it():
    res = subprocess.run(command(["sleep", "600"], parent_pid=1), capture_output=True, text=True, timeout=30)
    assert res.returncode == 1 and "the parent 1 died before sleep started" in res.stderr
    res = subprocess.run([sys.executable, "-m", "harness_recipes.node.die_with_parent", "x"], capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 1 and "usage:" in res.stderr
