"""Tampering agents on a bundled SWE-style instance (docker runtime): grading runs in a fresh container
of the instance image with only the node-computed model patch, so none of the attacks moves the reward.

The agent is a script run in the episode's container the way node/episode.py runs a harness
(sandbox.exec in /testbed); each attack is first shown to work in place (a control), then graded
by node/grading.py. Also: the image's /testbed holds no commit after base_commit.
"""
from __future__ import annotations

import asyncio
import hashlib
import shutil
import subprocess
from pathlib import Path

from harness_recipes.node.grading import grade_episode
from harness_recipes.tasks.swebench.images import build_instance, ensure_base
from harness_recipes.tasks.swebench.instances import load_instances

ROOT = Path(__file__).resolve().parents[2]
MINI = ROOT / "data" / "swebench" / "mini.jsonl"
INFLECTION = "jpvanhal__inflection-ordinal-thirteen"
FIX = "sed -i 's/number % 100 in (11, 12):/number % 100 in (11, 12, 13):/' inflection/__init__.py\n"
PASS_ALL = """cat > conftest.py <<'EOF'
import pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
EOF
"""
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root"}


def inflection():
    (task,) = load_instances(MINI, instances=[INFLECTION])
    return task


async def agent(rt, task, eid: str, script: str, control: str | None = None):
    sb = await rt.prepare(task, eid, Path("/usr/bin/python3"))
    res = await sb.exec(["bash", "-c", script], ENV, timeout=60, cwd=sb.workspace)
    assert res.rc == 0, (res.stdout + res.stderr).decode()
    out = None
    if control:
        c = await sb.exec(["bash", "-c", control], ENV, timeout=120, cwd=sb.workspace)
        out = (c.rc, (c.stdout + c.stderr).decode(errors="replace"))
    return sb, out


def test_tampering_agents_get_nothing_and_a_fix_gets_one(tmp_path, docker_runtime_cls):
    t = inflection()
    inst = t.swebench
    fake_tests = "\n".join(f"print({'PASSED ' + n!r})" for n in inst["FAIL_TO_PASS"] + inst["PASS_TO_PASS"])
    conftest = PASS_ALL + "echo conftest.py >> .git/info/exclude\n"
    hooks = f"""{FIX}
printf '#!/bin/sh\\necho SPY-RAN "$0" >&2\\n' > /root/spy.sh && chmod +x /root/spy.sh
cp /root/spy.sh .git/hooks/post-checkout
git config core.fsmonitor /root/spy.sh
git config diff.external /root/spy.sh
"""
    site = f"""
d=$(python3 -c 'import os, pytest; print(os.path.dirname(pytest.__file__))')
cat > "$d/__main__.py" <<'EOF'
{fake_tests}
EOF
{PASS_ALL}mv conftest.py /root/conftest.py
setsid nohup sh -c 'while :; do cp /root/conftest.py /testbed/conftest.py; sleep 0.2; done' >/dev/null 2>&1 &
"""
    rt = docker_runtime_cls(network="none", memory="1g", cpus=1.0, workdir=str(tmp_path))

    async def go():
        try:
            sa, ca = await agent(rt, t, "conftest.s0", conftest, inst["eval_script"])
            sb, cb = await agent(rt, t, "git.s0", hooks, "git checkout -q HEAD -- test_inflection.py; git status")
            sc, cc = await agent(rt, t, "site.s0", site, "sleep 1; ls conftest.py && python3 -m pytest")
            sd, _ = await agent(rt, t, "fix.s0", FIX)
            return (ca, cb, cc), await asyncio.gather(*(
                grade_episode(rt, t, eid, sb_, Path("/usr/bin/python3"), PATH, tmp_path / "out" / eid,
                              workdir=str(tmp_path))
                for sb_, eid in [(sa, "conftest.s0"), (sb, "git.s0"), (sc, "site.s0"), (sd, "fix.s0")]))
        finally:
            await rt.shutdown()

    (ca, cb, cc), (a, b, c, d) = asyncio.run(go())
    out = tmp_path / "out"
    assert rt.leftovers() == []

    # (a) a hidden conftest that passes everything: in place the failing test passes (control) ...
    assert "PASSED test_inflection.py::test_ordinal" in ca[1] and "FAILED" not in ca[1], ca[1][-2000:]
    # ... graded in a fresh container without it: reward 0, the stripped path recorded
    assert a.reward == 0.0 and not a.error and a.eval["stripped_paths"] == ["conftest.py"], a.eval
    assert a.swebench["resolved"] is False and a.swebench["patch_successfully_applied"] is True

    # (b) a post-checkout hook, core.fsmonitor, diff.external: they run in place (control), never in
    # grading (the eval script's git checkout/status/diff would print their marker in the log) ...
    assert "SPY-RAN" in cb[1], cb[1]
    assert "SPY-RAN" not in (out / "git.s0" / "test_output.txt").read_text()
    # ... and the recorded patch is the true file-tree diff
    patch = (out / "git.s0" / "model.patch").read_text()
    assert "+    elif number % 100 in (11, 12, 13):" in patch or "(11, 12, 13)" in patch, patch
    assert "SPY" not in patch and b.reward == 1.0 and not b.error, b.eval

    # (c) site-packages pytest replaced and a process left rewriting a conftest: both work in place
    # (control) and are gone with the agent's container: reward 0
    assert cc[0] == 0 and "PASSED test_inflection.py::test_ordinal" in cc[1], cc
    assert c.reward == 0.0 and not c.error and c.swebench["resolved"] is False, c.eval
    log = (out / "site.s0" / "test_output.txt").read_text()
    assert "FAILED" in log and "test session starts" in log  # the real pytest ran

    # (d) the control: a real fix is resolved; the record says how it was graded
    assert d.reward == 1.0 and d.swebench["resolved"] is True, d.eval
    raw = (out / "fix.s0" / "model.patch").read_bytes()
    assert d.eval["grading"] == "fresh-container" and d.eval["kind"] == "swebench"
    assert d.eval["instance_id"] == INFLECTION and d.eval["stripped_paths"] == []
    assert d.eval["patch_sha256"] == hashlib.sha256(raw).hexdigest() and d.eval["patch_bytes"] == len(raw)
    assert d.changed == ["inflection/__init__.py"]


def test_an_instance_image_holds_no_commit_after_base(tmp_path, docker_runtime_cls):
    """A repository whose later commit holds the gold fix (on a branch, tagged): the image built from it
    has base_commit and its ancestors only, and the fix's blob is not in it."""
    from harness_recipes.docker_engine import docker_client
    t = inflection()
    base = t.swebench["base_commit"]
    repo = tmp_path / "repo"
    shutil.copytree(t.git_repo, repo, symlinks=True)
    env = {"PATH": PATH, "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True, text=True).stdout

    (repo / "p.patch").write_text(t.swebench["patch"])
    git("apply", "p.patch")
    (repo / "p.patch").unlink()
    # the bundled bug was planted over the published file, so the plain fix restores an ancestor's
    # blob: a line of its own makes the gold blob one that only the later commit has
    with open(repo / "inflection" / "__init__.py", "a") as f:
        f.write("# the gold fix\n")
    git("commit", "-qam", "the gold fix")
    git("tag", "fixed")
    gold_commit, gold_blob = git("rev-parse", "HEAD").strip(), git("rev-parse", "HEAD:inflection/__init__.py").strip()
    git("checkout", "-q", base)  # HEAD at base, the fix on master and a tag

    client = docker_client()
    tag = f"polar-test-history:{gold_commit[:12]}"
    build_instance(client, t.swebench, repo, ensure_base(client), tag)
    try:
        script = (f"cd /testbed && git log --all --format=%H && echo --- && git rev-list --all --reflog && echo --- "
                  f"&& git fsck --unreachable --no-reflogs --no-progress && echo --- && git rev-list {base} "
                  f"&& echo --- && (git cat-file -e {gold_blob} 2>/dev/null && echo HAS-GOLD || echo no-gold)")
        out = client.containers.run(tag, ["bash", "-c", script], network_mode="none", remove=True).decode()
    finally:
        client.images.remove(tag, force=True)
    log_all, rev_all, fsck, ancestry, gold = [part.split() for part in out.split("---")]
    assert gold_commit not in log_all + rev_all, out
    assert set(log_all) == set(rev_all) == set(ancestry) and base in ancestry, out
    assert fsck == [] and gold == ["no-gold"], out
