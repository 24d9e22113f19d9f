"""A stand-in harness CLI for the scheduler tests: behaves as told on its command line.

    fake_harness.py fix FILE OLD NEW   replace OLD by NEW in FILE (the 'agent' fixes the bug)
    fake_harness.py noop               change nothing, exit 0
    fake_harness.py crash              exit 3 with a message on stderr
    fake_harness.py hang PIDFILE       start a background child, write both pids, sleep forever
    fake_harness.py sleep SECS         sleep, then exit 0

It also writes the config file and env it was given to ./.fake-seen.json so tests can check the
recipe's templates reached the harness.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    seen = {"cwd": os.getcwd(), "env": {k: v for k, v in os.environ.items() if k.startswith(("FAKE_", "HOME"))}}
    Path(".fake-seen.json").write_text(json.dumps(seen))
    if mode == "fix":
        path, old, new = args
        p = Path(path)
        p.write_text(p.read_text().replace(old, new))
        return 0
    if mode == "noop":
        return 0
    if mode == "crash":
        print("fake harness: simulated crash", file=sys.stderr)
        return 3
    if mode == "hang":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        Path(args[0]).write_text(f"{os.getpid()} {child.pid}")
        time.sleep(3600)
    if mode == "sleep":
        time.sleep(float(args[0]))
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
