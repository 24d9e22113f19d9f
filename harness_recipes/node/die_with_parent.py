"""``python -m harness_recipes.node.die_with_parent PARENT_PID CMD...``: run CMD (exec, same pid) so that
the kernel kills it when the process that started it dies (Linux ``PR_SET_PDEATHSIG``).

Why: a fleet node's capture proxies are ordinary processes started by its Ray actor. When the
actor's process dies without running its cleanup (its raylet killed, the actor killed, OOM), the
proxies would live on with their ports and logs on a shared host. The death signal survives the
exec, so the proxy itself gets it. It is sent when the *thread* that started the child exits:
start such children from a thread that lives as long as the process means them to (an actor's
event loop), never from a short-lived worker thread.

PARENT_PID closes the race where the parent dies before the prctl: then the child exits at once.
On systems without prctl the command runs without the guarantee, and says so on stderr.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return False
    if prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True


def command(cmd: list[str], parent_pid: int | None = None) -> list[str]:
    """``cmd`` wrapped so it dies with ``parent_pid`` (default: this process)."""
    return [sys.executable, "-m", "harness_recipes.node.die_with_parent", str(parent_pid or os.getpid()), *cmd]


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m harness_recipes.node.die_with_parent PARENT_PID CMD [ARGS...]")
    if not set_parent_death_signal():
        print("die_with_parent: no prctl here: the command will not die with its parent", file=sys.stderr)
    if os.getppid() != int(argv[0]):
        sys.exit(f"die_with_parent: the parent {argv[0]} died before {argv[1]} started")
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
