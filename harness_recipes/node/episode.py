"""One episode's phases, each a plain async function: prewarm, run the harness, evaluate, end.

The scheduler (scheduler.py) decides when each phase runs; these functions only do the work and
return what happened. Nothing here swallows cancellation: Ctrl-C reaches the process kill code.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from harness_recipes.node.proxies import pick
from harness_recipes.recipes.recipe import Recipe
from harness_recipes.runtimes.base import ExecResult, Sandbox
from harness_recipes.runtimes.file_tree import Budget
from harness_recipes.tasks.task_file import Task
from polar_contracts.control import capability, control_headers, end_path, episode_prefix

EPISODE_RE = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
# Statuses. Terminal ones are skipped on resume; the others are retried under a new attempt id.
DONE, TIMEOUT, CRASHED, EVAL_ERROR = "done", "timeout", "crashed", "eval_error"
ERROR, INTERRUPTED = "error", "interrupted"
# The sandbox reached one of its limits (memory, processes, disk: recipes/limits.py) and was stopped;
# the record's error says which. The agent's doing, like a crash: graded, kept, not retried.
RESOURCE_LIMIT = "resource_limit"
TERMINAL = (DONE, TIMEOUT, CRASHED, EVAL_ERROR, RESOURCE_LIMIT)


def episode_id(task_id: str, sample: int, attempt: int) -> str:
    eid = f"{task_id}.s{sample}" + (f".a{attempt}" if attempt else "")
    if not EPISODE_RE.match(eid):
        raise ValueError(f"episode id {eid!r} is not valid ([A-Za-z0-9._-]{{1,128}})")
    return eid


@dataclass
class Settings:
    proxy: str  # the capture proxy's base URL, e.g. http://127.0.0.1:8080
    model: str = "polar-model"
    # Several proxies on this node (proxies.py): each episode goes to one of them, by its id; empty: `proxy`.
    proxies: tuple[str, ...] = ()
    api_key: str = "polar-local-key"  # a placeholder: the proxy/server in this setup need no real key
    # Base environment for harness and evaluation. Not the caller's environment: no secrets leak in.
    base_path: str = field(default_factory=lambda: os.environ.get("PATH", "/usr/bin:/bin"))
    # The proxies' control secret (None: open proxies). The node alone holds it: it ends episodes
    # and syncs weights with it, and hands each harness only its episode's capability, which
    # authorizes that episode's model calls and nothing else. Never in a harness's env or files.
    control_secret: str | None = field(default=None, repr=False)
    # What the proxy said its control plane is (node/proxy_control.py: "secured" | "open"); None:
    # not asked (the node's own proxies: secured with its secret). On every row (control_plane).
    control_plane: str | None = None
    # Bounds on grading's reading of the agent's tree and on its patch (runtimes/file_tree.py).
    grading_budget: Budget = field(default_factory=Budget)

    def control_mark(self) -> str:
        """The end metadata's "control_plane": what the proxy said, else what the node's secret implies."""
        if self.control_plane is not None:
            return self.control_plane
        return "secured" if self.control_secret else "open"

    def episode_name(self, eid: str) -> str:
        """What the harness names its episode by: the capability (a bare id for an open proxy)."""
        return capability(self.control_secret, eid) if self.control_secret else eid

    def proxy_for(self, eid: str) -> str:
        """The proxy of episode ``eid``: all its calls and its end go there (its log has one writer)."""
        if not self.proxies:
            return self.proxy
        return self.proxies[pick(eid, len(self.proxies))]


def episode_vars(recipe: Recipe, exe: Path, sandbox: Sandbox, task: Task, eid: str, s: Settings,
                 exe_view: str | None = None) -> dict[str, str]:
    # The host:port the harness sees: inside a sandbox, its own loopback forwarder (api_socket.py).
    proxy = sandbox.api_base(s.proxy_for(eid)).rstrip("/")
    name = s.episode_name(eid)
    base_url = proxy + episode_prefix(name) if recipe.episode_via == "path" else proxy
    return {
        "bin": exe_view or str(exe), "prefix": str(exe.parent), "home": sandbox.home, "workspace": sandbox.workspace,
        "prompt": task.prompt, "model": s.model, "api_key": s.api_key, "episode": name, "proxy": proxy,
        "base_url": base_url, "episode_header": recipe.episode_header, "task_id": task.id,
    }


def check_no_secret(s: Settings, what: str, texts) -> None:
    """Refuse to hand the harness anything holding the control secret (a recipe that renders it
    into an env var, a config file or its argv would give the agent the whole control plane)."""
    if s.control_secret and any(s.control_secret in t for t in texts):
        raise RuntimeError(f"the proxies' control secret would reach the harness through its {what}; refusing to "
                           f"run it (the harness gets its episode's capability only)")


def harness_env(recipe: Recipe, values: dict[str, str], s: Settings, node_dir: str | None) -> dict[str, str]:
    path = s.base_path if not node_dir else f"{node_dir}:{s.base_path}"
    env = {"PATH": path, "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1", "CI": "1", "TMPDIR": "/tmp",
           "USER": os.environ.get("USER", "root")}
    env.update(recipe.render_env(values))
    check_no_secret(s, "environment", [*env.keys(), *env.values()])
    return env


async def write_config(recipe: Recipe, sandbox: Sandbox, values: dict[str, str], s: Settings | None = None) -> None:
    files = list(recipe.render_files(values))
    if s is not None:
        check_no_secret(s, "config files", [c if isinstance(c, str) else c.decode("utf-8", "replace")
                                            for _, c in files])
    for path, content in files:
        await sandbox.write_file(path, content)


async def run_harness(recipe: Recipe, sandbox: Sandbox, values: dict[str, str], env: dict[str, str],
                      timeout: float, s: Settings | None = None) -> ExecResult:
    argv = recipe.render_argv(values)
    if s is not None:
        check_no_secret(s, "command line", argv)
    # Behind the inner forwarder when the model API comes in through the sandbox's socket: it lets only
    # the harness (and the helpers the recipe names) call the model, not the agent's commands.
    argv = sandbox.harness_argv(argv, recipe.model_callers)
    return await sandbox.exec(argv, env, timeout=timeout, cwd=sandbox.workspace)


def harness_status(res: ExecResult) -> str:
    if res.limit:
        return RESOURCE_LIMIT
    if res.timed_out:
        return TIMEOUT
    return DONE if res.rc == 0 else CRASHED


async def post_end(proxy: str, eid: str, reward: float, metadata: dict, timeout: float = 10.0,
                   secret: str | None = None) -> str:
    """Tell the capture proxy the episode is over (with its control secret); returns an error
    string ('' on success)."""
    url = proxy.rstrip("/") + end_path(eid)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as http:
            async with http.post(url, json={"reward": reward, "metadata": metadata},
                                 headers=control_headers(secret)) as resp:
                if resp.status // 100 != 2:
                    return f"POST {url} -> HTTP {resp.status}: {(await resp.text())[:300]}"
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return f"POST {url} failed: {type(e).__name__}: {e}"
    return ""


def save_output(dirpath: Path, name: str, res: ExecResult | None) -> None:
    if res is None:
        return
    dirpath.mkdir(parents=True, exist_ok=True)
    (dirpath / f"{name}.stdout").write_bytes(res.stdout)
    (dirpath / f"{name}.stderr").write_bytes(res.stderr)


def node_dir() -> str | None:
    node = shutil.which("node")
    return str(Path(node).parent) if node else None


def tail(data: bytes, n: int = 400) -> str:
    return data.decode(errors="replace")[-n:]


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)
