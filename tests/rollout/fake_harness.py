"""A stand-in harness CLI for the scheduler tests: behaves as told on its command line.

    fake_harness.py fix FILE OLD NEW   replace OLD by NEW in FILE (the 'agent' fixes the bug)
    fake_harness.py apply PATCH        apply a unified diff to the working tree (git apply)
    fake_harness.py write FILE TEXT    write TEXT to FILE (e.g. a tampering conftest.py)
    fake_harness.py noop               change nothing, exit 0
    fake_harness.py crash              exit 3 with a message on stderr
    fake_harness.py hang PIDFILE       start a background child, write both pids, sleep forever
    fake_harness.py sleep SECS         sleep, then exit 0
    fake_harness.py per-sample DIR     run DIR/s<n>.sh with bash, n the episode's sample number (from
                                       $FAKE_EPISODE, `<task>.s<n>`): one scripted agent per episode
                                       of a group. A child process, as a harness's shell tool runs a
                                       command (its own model calls are the agent's, not the harness's)
    fake_harness.py chat N MODE ...    first N streamed chat calls to $FAKE_BASE/v1/chat/completions
                                       (model $FAKE_MODEL), each call's answer in the next prompt;
                                       exit 4 on a failed call; then MODE ... as above

It also writes the config file and env it was given to ./.fake-seen.json so tests can check the
recipe's templates reached the harness.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path


def chat(n: int) -> int:
    """n model calls through the capture proxy, as a harness makes them (stdlib only)."""
    import urllib.request
    messages = [{"role": "user", "content": f"episode {os.environ.get('FAKE_EPISODE')}: fix calc.py"}]
    for i in range(n):
        body = {"model": os.environ.get("FAKE_MODEL", "polar-model"), "messages": messages, "max_tokens": 4,
                "stream": True, "temperature": 1.0}
        req = urllib.request.Request(os.environ["FAKE_BASE"].rstrip("/") + "/v1/chat/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                text = r.read().decode()
        except OSError as exc:
            print(f"fake harness: call {i} failed: {exc}", file=sys.stderr)
            return 4
        if not text.rstrip().endswith("data: [DONE]"):
            print(f"fake harness: call {i} stream did not end with [DONE]: {text[-300:]}", file=sys.stderr)
            return 4
        reply = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                        for line in text.splitlines()
                        if line.startswith("data: {") and json.loads(line[6:]).get("choices"))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"go on ({i})"}]
    return 0


def main() -> int:
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "chat":
        rc = chat(int(args[0]))
        if rc or len(args) == 1:
            return rc
        mode, args = args[1], args[2:]
    seen = {"cwd": os.getcwd(), "env": {k: v for k, v in os.environ.items() if k.startswith(("FAKE_", "HOME"))}}
    Path(".fake-seen.json").write_text(json.dumps(seen))
    if mode == "fix":
        path, old, new = args
        p = Path(path)
        p.write_text(p.read_text().replace(old, new))
        return 0
    if mode == "apply":
        return subprocess.run(["git", "apply", "--whitespace=nowarn", args[0]]).returncode
    if mode == "write":
        Path(args[0]).parent.mkdir(parents=True, exist_ok=True)
        Path(args[0]).write_text(args[1])
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
    if mode == "per-sample":
        m = re.search(r"\.s(\d+)", os.environ.get("FAKE_EPISODE", ""))
        script = Path(args[0]) / f"s{m.group(1) if m else 0}.sh"
        return subprocess.run(["bash", str(script)]).returncode
    if mode == "sleep":
        time.sleep(float(args[0]))
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
