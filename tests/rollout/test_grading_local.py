"""Tampering agents on the local runtime (bubblewrap): grading in a fresh workspace cannot be touched.

The agent is a script run in the episode's sandbox the way node/episode.py runs a harness
(sandbox.exec in the workspace); then node/grading.py grades it. Each attack first proves it works
where it runs (a control in the agent's own sandbox), then is graded.
"""
from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from pathlib import Path

import pytest

from harness_recipes.node.grading import grade_episode
from harness_recipes.runtimes.local import LocalRuntime, bwrap_available
from harness_recipes.tasks.task_file import parse_task

ROOT = Path(__file__).resolve().parents[2]
REPO = ROOT / "data" / "tasks" / "repos" / "fix_add"
EVAL = f"git checkout -q HEAD -- test_calc.py && {sys.executable} -m pytest -q -p no:cacheprovider test_calc.py"
FIX = "sed -i 's/return a - b/return a + b/' calc.py\n"
PASS_ALL = """cat > conftest.py <<'EOF'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
EOF
"""
ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}


@pytest.fixture
def runtime(tmp_path):
    if not bwrap_available():
        pytest.skip("bubblewrap cannot create namespaces here: local grading is tamper-proof only under it")
    return LocalRuntime(isolation="bwrap", workdir=str(tmp_path), keep=True)


def task():
    return parse_task({"id": "add", "workspace": str(REPO), "prompt": "fix calc.py", "eval": EVAL}, ROOT, "test")


async def agent(runtime, eid: str, script: str, control: str | None = None):
    """Run the agent's script in a new episode sandbox; ``control``: a command whose rc proves the attack
    works in place. Returns (sandbox, control rc)."""
    sb = await runtime.prepare(task(), eid, Path(sys.executable))
    env = {**ENV, "HOME": sb.home}
    res = await sb.exec(["bash", "-c", script], env, timeout=60, cwd=sb.workspace)
    assert res.rc == 0, res.stderr.decode()
    rc = None
    if control:
        rc = (await sb.exec(["bash", "-c", control], env, timeout=60, cwd=sb.workspace)).rc
    return sb, rc


async def graded(runtime, sb, eid: str, tmp_path: Path):
    return await grade_episode(runtime, task(), eid, sb, Path(sys.executable), ENV["PATH"], tmp_path / "out" / eid,
                               workdir=str(tmp_path))


def test_tampering_agents_get_nothing_and_a_fix_gets_one(tmp_path, runtime):
    hooks = f"""{FIX}
cat > "$HOME/spy.sh" <<'EOF'
#!/bin/sh
touch "$HOME/$(basename "$0")-ran"; echo FORGED
EOF
chmod +x "$HOME/spy.sh"
cp "$HOME/spy.sh" .git/hooks/post-checkout
git config core.fsmonitor "$HOME/spy.sh"
git config diff.external "$HOME/spy.sh"
echo 'hidden.py' >> .git/info/exclude
echo 'X = 1' > hidden.py
"""
    background = f"""{PASS_ALL}mv conftest.py "$HOME/conftest.py"
setsid nohup bash -c 'while :; do
  date +%s%N > "$HOME/beat"
  for d in {tmp_path}/polar-*.grade-*/workspace; do cp "$HOME/conftest.py" "$d/" 2>/dev/null; done
  sleep 0.1
done' >/dev/null 2>&1 &
sleep 1  # it runs: its heartbeat is written
test -s "$HOME/beat"
"""

    async def go():
        sa, ca = await agent(runtime, "tamper-conftest", PASS_ALL + "echo conftest.py >> .git/info/exclude\n", EVAL)
        sb, cb = await agent(runtime, "tamper-git", hooks, "git checkout -q HEAD -- test_calc.py && git status -s")
        sc, _ = await agent(runtime, "tamper-background", background)
        sd, _ = await agent(runtime, "fix", FIX)
        return (ca, cb), await asyncio.gather(*(graded(runtime, s, e, tmp_path) for s, e in
                                               [(sa, "tamper-conftest"), (sb, "tamper-git"),
                                                (sc, "tamper-background"), (sd, "fix")])), (sa, sb, sc)

    (ca, cb), (a, b, c, d), (sa, sb, sc) = asyncio.run(go())

    # (a) a conftest that passes everything, hidden from the agent's git: it worked in place (control),
    # is stripped from the patch and recorded; the tests fail in the fresh workspace.
    assert ca == 0
    assert a.reward == 0.0 and not a.error and a.eval["stripped_paths"] == ["conftest.py"], a
    assert "conftest" not in (tmp_path / "out" / "tamper-conftest" / "model.patch").read_text()

    # (b) hooks, fsmonitor and an external diff in the agent's repository: they ran there (control),
    # not when the node took the patch, not in grading; the patch is the true file-tree diff.
    home_b = Path(sb.home)
    assert cb == 0 and (home_b / "post-checkout-ran").exists() and (home_b / "spy.sh-ran").exists()
    for p in (home_b / "post-checkout-ran", home_b / "spy.sh-ran"):
        p.unlink()
    assert b.reward == 1.0 and not b.error, b
    patch = (tmp_path / "out" / "tamper-git" / "model.patch").read_text()
    assert "FORGED" not in patch and "+    return a + b" in patch and "b/hidden.py" in patch
    ran = [str(p) for p in tmp_path.glob("polar-*/home/*-ran")]
    assert ran == [], ran

    # (c) a background process left running: it died with the agent's sandbox (its heartbeat stops)
    # and never saw the grading workspace.
    assert c.reward == 0.0 and not c.error, c
    beat = Path(sc.home) / "beat"
    before = beat.read_text()
    time.sleep(0.5)
    assert beat.read_text() == before
    assert not list(tmp_path.glob("polar-*.grade-*/workspace/conftest.py"))

    # (d) the control: a real fix
    assert d.reward == 1.0 and not d.error, d
    raw = (tmp_path / "out" / "fix" / "model.patch").read_bytes()
    assert d.eval["grading"] == "fresh-workspace" and d.eval["kind"] == "command"
    assert d.eval["patch_sha256"] == hashlib.sha256(raw).hexdigest() and d.eval["patch_bytes"] == len(raw)
    assert d.eval["stripped_paths"] == [] and d.changed == ["calc.py"]
