"""`polar-rollout swebench plan FILE`: for each instance, how it would run here, before running it.

- ``official``: the local docker engine has its official image (either name, or the row's `image`);
  it runs there, its conda env activated, the official eval script;
- ``build``: no official image, but its environment can be built here (environment.py: Debian's
  Python, PyPI wheels, the repository at base_commit from --repos);
- ``refused``: neither; the reason says what is missing (a Python Debian does not ship, conda-only
  packages, no local repository, ...). `polar-rollout run/fleet` leave these out up front.

Reads the rows, the spec tables, the local repositories and the local docker engine's image list
(a Unix socket): nothing from the network. Without a reachable engine no official image is found,
and the plan says so.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from harness_recipes.docker_engine import docker_client_or_none
from harness_recipes.tasks.swebench.environment import Refused, environment, spec_refusal
from harness_recipes.tasks.swebench.specs import SpecError, language, source, spec_for, tables


@dataclass
class Decision:
    instance_id: str
    repo: str
    version: str
    python: str  # the spec's Python version ("" when there is no spec)
    path: str  # official | build | refused
    image: str  # the official image found, or "" (built images are named when built)
    reason: str  # refused: why; official/build: what it will use


def decide(inst: dict, repo: Path | None, repos: Path | None, client=None) -> Decision:
    from harness_recipes.tasks.swebench.images import find_official, official_candidates, uses_spec
    try:
        python = str(spec_for(inst["repo"], inst["version"]).get("python", ""))
    except SpecError:
        python = ""
    d = Decision(inst["instance_id"], inst["repo"], inst["version"], python, "refused", "", "")
    found = find_official(client, inst) if client is not None else None
    if found is not None:
        d.path, d.image, d.reason = "official", found[0], "official image in the local docker"
        return d
    if not uses_spec(inst):
        if repo is None:
            d.reason = f"no official image ({official_candidates(inst)[0]}) and no local repository to build from"
        else:
            d.path, d.reason = "build", "the row's own eval_script, on the Debian base"
        return d
    try:
        env = environment(inst, repo, repos)
    except Refused as e:
        d.reason = str(e)
        return d
    d.path = "build"
    d.reason = env.describe()
    return d


def docker_client():
    """The local engine, or None (then no official image can be found: the plan says so)."""
    return docker_client_or_none()


def plan(tasks, client) -> list[Decision]:
    out = []
    for t in tasks:
        inst = t.swebench
        repos = Path(inst["polar_repos"]) if inst.get("polar_repos") else None
        out.append(decide(inst, t.git_repo, repos, client))
    return out


def totals(decisions: list[Decision]) -> dict:
    c = Counter(d.path for d in decisions)
    return {"instances": len(decisions), "official": c["official"], "build": c["build"], "refused": c["refused"]}


def _short(reason: str) -> str:
    return reason.replace("|", "\\|")


def table(decisions: list[Decision], engine: bool) -> str:
    lines = ["| instance | repo | version | python | path | image / reason |", "|---|---|---|---|---|---|"]
    for d in decisions:
        lines.append(f"| {d.instance_id} | {d.repo} | {d.version} | {d.python or '-'} | {d.path} | "
                     f"{_short(d.image or d.reason)} |")
    t = totals(decisions)
    lines += ["", f"{t['instances']} instances: {t['official']} official image, {t['build']} buildable here, "
                  f"{t['refused']} refused."]
    if not engine:
        lines.append("No local docker engine answered: official images were not looked up.")
    built = Counter(f"Python {d.python}" + (" (conda packages from PyPI)" if "from PyPI" in d.reason else "")
                    for d in decisions if d.path == "build")
    if built:
        lines += ["", "Buildable, by Python:"] + [f"- {n} x {k}" for k, n in sorted(built.items())]
    # a refusal for want of the repository comes after every spec check: those build once it is given
    need_repo = Counter(d.repo for d in decisions if d.path == "refused" and d.reason.startswith("no local repository"))
    if need_repo:
        lines += ["", f"{sum(need_repo.values())} of the refused build here once their repository is given "
                      f"(--repos): " + ", ".join(f"{r} {n}" for r, n in need_repo.most_common()) + "."]
    # the reasons, grouped, say what it would take to run the refused ones
    why = Counter(_reason_kind(d.reason) for d in decisions if d.path == "refused")
    if why:
        lines += ["", "Refused, by reason:"] + [f"- {n} x {k}" for k, n in why.most_common()]
    return "\n".join(lines) + "\n"


def _reason_kind(reason: str) -> str:
    """The reason less what is particular to the instance (commits, the advice), to count alike ones."""
    kind = re.sub(r"\b[0-9a-f]{7,40}\b", "<commit>", reason).split(": use the official image")[0]
    return kind.split(";")[0] if kind.startswith("needs Python") else kind.split(" (")[0]


def as_json(decisions: list[Decision], engine: bool) -> str:
    return json.dumps({"totals": totals(decisions), "engine": engine,
                       "instances": [asdict(d) for d in decisions]}, indent=1) + "\n"


def spec_table() -> str:
    """Per Python repo and version in the spec tables: buildable here, or why not. Every SWE-bench
    (Verified, Lite, full) instance falls under one of these; an instance of a buildable spec also
    needs its repository (and requirements) on this machine (`plan` says so per instance)."""
    specs = tables()["MAP_REPO_VERSION_TO_SPECS"]
    lines = [f"Spec tables: {source()}", "", "| repo | versions | python | packages | here |", "|---|---|---|---|---|"]
    counts = Counter()
    for repo in sorted(r for r in specs if language(r) == "py"):
        groups: dict[tuple, list[str]] = {}
        for version, spec in specs[repo].items():
            why = spec_refusal(repo, spec)
            key = (str(spec.get("python", "")), str(spec.get("packages", "") or "-"), "build" if not why else
                   "refused: " + why.split(";")[0].split(" (")[0].split(":")[0])
            groups.setdefault(key, []).append(version)
            counts["build" if not why else "refused"] += 1
        for (py, pkgs, verdict), versions in groups.items():
            lines.append(f"| {repo} | {', '.join(versions)} | {py} | {_short(pkgs)[:40]} | {verdict} |")
    lines += ["", f"{counts['build'] + counts['refused']} Python specs: {counts['build']} buildable here, "
                  f"{counts['refused']} refused (official image needed)."]
    return "\n".join(lines) + "\n"
