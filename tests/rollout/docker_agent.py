"""A scripted agent for SWE-bench rows in docker, graded through node/grading.py: the agent's sandbox
is prepared as an episode's, the agent applies a patch and/or appends code to a module under test
(as a tampering policy would), then the episode is graded as the node grades it."""
from __future__ import annotations

from pathlib import Path

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV = {"PATH": PATH, "LANG": "C.UTF-8", "HOME": "/root"}


def scripted_agent(rt, task, module: str, tmp_path: Path):
    """``await agent(eid, patch, append)`` -> the episode's Graded; ``module``: where ``append`` goes."""
    from harness_recipes.node.grading import grade_episode

    async def agent(eid: str, patch: str | None, append: str | None):
        sb = await rt.prepare(task, eid, Path("/usr/bin/python3"))
        if patch:
            await sb.write_file(f"{sb.home}/agent.patch", patch)
            res = await sb.exec(["git", "apply", f"{sb.home}/agent.patch"], ENV, timeout=60, cwd=sb.workspace)
            assert res.rc == 0, res
        if append:
            await sb.write_file(f"{sb.home}/append.py", append)
            res = await sb.exec(["bash", "-c", f"cat {sb.home}/append.py >> {module}"], ENV, timeout=60,
                                cwd=sb.workspace)
            assert res.rc == 0, res
        return await grade_episode(rt, task, eid, sb, Path("/usr/bin/python3"), PATH, tmp_path / "out" / eid,
                                   workdir=str(tmp_path))
    return agent
