"""An experiment as one TOML file (harness_recipes/fleet/experiments/*.toml): the served model and its
server, the harnesses and tasks, the fleet's shape, the trainer. `polar-rollout fleet --config FILE
--dry-run` checks everything that can be checked on this machine and prints the plan; nothing is
started and nothing is written. Without ``--dry-run`` it runs the plan's fleets (``fleet_runs``):
one per harness, one after the other, on the file's Ray cluster (or ``--local N`` here).

What is checked here: every key (unknown ones are errors, so a typo never silently falls back to a
default), the server engine and URL, each harness's recipe, the task file's shape (when the file
is on this machine; else the plan says it was not checked), the store URI's form, the trainer's
flags against PolarGRPOConfig's fields, and the Ray resources each node's actor and sandboxes
need. What is not: that the cluster, the server, the store and the model exist (they are not here).
"""
from __future__ import annotations

import dataclasses
import tomllib
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from harness_recipes.recipes.recipe import RecipeError, load_recipe
from harness_recipes.tasks.swebench.instances import PREFIX, is_swebench_spec, load_instances
from harness_recipes.tasks.task_file import TaskError, load_swebench, load_tasks
from trainer.grpo_config import PolarGRPOConfig
from trainer.train_grpo import ScriptArguments

ENGINES = ("sglang", "vllm")
STORE_SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "abfs", "abfss")
SECTIONS = {
    "experiment": {"name", "description"},
    "model": {"hf_id", "served_name"},
    "server": {"engine", "url", "command"},
    "rollout": {"harnesses", "tasks", "swebench", "repos", "samples", "runtime", "isolation", "concurrency",
                "prewarm", "eval_concurrency"},
    "fleet": {"ray_address", "nodes", "proxies_per_node", "cpus_per_sandbox", "store", "max_attempts"},
    "trainer": {"launcher", "launcher_args", "args"},
}


class ExperimentError(ValueError):
    """A config that cannot run; the message names the file, the key and the problem."""


@dataclass
class Experiment:
    path: Path
    name: str
    model: dict
    server: dict
    rollout: dict
    fleet: dict
    trainer: dict
    notes: list[str] = field(default_factory=list)  # what the dry run could not check here, and why


def _get(table: dict, key: str, kind, where: str, default=...):
    if key not in table:
        if default is ...:
            raise ExperimentError(f"{where}: missing key {key!r}")
        return default
    v = table[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ExperimentError(f"{where}.{key} must be {names}, not {v!r}")
    return v


def load_experiment(path: str | Path) -> Experiment:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ExperimentError(f"{path}: no such experiment file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ExperimentError(f"{path}: not valid TOML: {exc}") from None
    for sec in set(raw) - set(SECTIONS):
        raise ExperimentError(f"{path}: unknown section [{sec}] (known: {', '.join(sorted(SECTIONS))})")
    for sec, keys in SECTIONS.items():
        if sec not in raw:
            raise ExperimentError(f"{path}: missing section [{sec}]")
        if extra := set(raw[sec]) - keys:
            raise ExperimentError(f"{path}: [{sec}] unknown keys {sorted(extra)} (known: {sorted(keys)})")
    w = str(path)
    exp = Experiment(path, _get(raw["experiment"], "name", str, f"{w} [experiment]"), raw["model"], raw["server"],
                     raw["rollout"], raw["fleet"], raw["trainer"])
    _check_server(exp, w)
    _check_rollout(exp, w)
    _check_fleet(exp, w)
    _check_trainer(exp, w)
    return exp


def _check_server(exp: Experiment, w: str) -> None:
    s = exp.server
    engine = _get(s, "engine", str, f"{w} [server]")
    if engine not in ENGINES:
        raise ExperimentError(f"{w} [server].engine must be one of {ENGINES}, not {engine!r}")
    url = urllib.parse.urlsplit(_get(s, "url", str, f"{w} [server]"))
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ExperimentError(f"{w} [server].url must be an http(s) URL, not {s['url']!r}")
    cmd = _get(s, "command", list, f"{w} [server]", [])
    if not all(isinstance(x, str) for x in cmd):
        raise ExperimentError(f"{w} [server].command must be a list of strings")
    _get(exp.model, "hf_id", str, f"{w} [model]")
    _get(exp.model, "served_name", str, f"{w} [model]")


def _check_rollout(exp: Experiment, w: str) -> None:
    r, where = exp.rollout, f"{w} [rollout]"
    harnesses = _get(r, "harnesses", list, where)
    if not harnesses or not all(isinstance(h, str) for h in harnesses) or len(set(harnesses)) != len(harnesses):
        raise ExperimentError(f"{where}.harnesses must be a non-empty list of distinct recipe names")
    for h in harnesses:
        try:
            load_recipe(h)
        except RecipeError as exc:
            raise ExperimentError(f"{where}.harnesses: {exc}") from None
    for key in ("samples", "concurrency", "prewarm", "eval_concurrency"):
        if _get(r, key, int, where, 1) < 1:
            raise ExperimentError(f"{where}.{key} must be >= 1")
    if _get(r, "runtime", str, where, "local") not in ("local", "docker"):
        raise ExperimentError(f"{where}.runtime must be local or docker, not {r['runtime']!r}")
    if _get(r, "isolation", str, where, "auto") not in ("auto", "bwrap", "none"):
        raise ExperimentError(f"{where}.isolation must be auto, bwrap or none, not {r['isolation']!r}")
    if ("tasks" in r) == ("swebench" in r):
        raise ExperimentError(f"{where}: give exactly one of tasks (a tasks JSONL) and swebench (+ repos)")
    base = exp.path.parent
    if "tasks" in r:
        spec = _get(r, "tasks", str, where)
        swe = is_swebench_spec(spec)  # swebench:FILE, SWE-bench instances (harness_recipes/tasks/swebench/)
        f = _resolve(base, spec[len(PREFIX):] if swe else spec)
        if not f.exists():
            exp.notes.append(f"tasks file {f} is not on this machine: its shape was not checked")
        else:
            try:
                r["_n_tasks"] = len(load_instances(f) if swe else load_tasks(f))
            except TaskError as exc:
                raise ExperimentError(f"{where}.tasks: {exc}") from None
    else:
        f = _resolve(base, _get(r, "swebench", str, where))
        repos = _resolve(base, _get(r, "repos", str, where))
        if not f.exists() or not repos.is_dir():
            exp.notes.append(f"SWE-bench file {f} and clones {repos} are not both on this machine: not checked "
                             f"(the cluster's nodes must have them at these paths)")
        else:
            try:
                r["_n_tasks"] = len(load_swebench(f, repos))
            except TaskError as exc:
                raise ExperimentError(f"{where}.swebench: {exc}") from None


def _check_fleet(exp: Experiment, w: str) -> None:
    f, where = exp.fleet, f"{w} [fleet]"
    _get(f, "ray_address", str, where)
    for key in ("nodes", "proxies_per_node", "cpus_per_sandbox", "max_attempts"):
        if _get(f, key, int, where, 1) < 1:
            raise ExperimentError(f"{where}.{key} must be >= 1")
    store = _get(f, "store", str, where)
    u = urllib.parse.urlsplit(store)
    if u.scheme not in STORE_SCHEMES or not (u.netloc or u.path.strip("/")):
        raise ExperimentError(f"{where}.store must be a filesystem URI ({', '.join(s + '://' for s in STORE_SCHEMES)}"
                              f"), not {store!r}")


def _check_trainer(exp: Experiment, w: str) -> None:
    t, where = exp.trainer, f"{w} [trainer]"
    if _get(t, "launcher", str, where) not in ("accelerate", "python"):
        raise ExperimentError(f"{where}.launcher must be accelerate or python, not {t['launcher']!r}")
    args = _get(t, "args", dict, where)

    known = {f.name for cls in (ScriptArguments, PolarGRPOConfig) for f in dataclasses.fields(cls)}
    if bad := sorted(set(args) - known):
        raise ExperimentError(f"{where}.args: not flags of polar-train (PolarGRPOConfig / ScriptArguments): {bad}")
    if "shards" in args:
        raise ExperimentError(f"{where}.args.shards: the trainer reads the fleet's store; leave it out")


def _resolve(base: Path, p: str) -> Path:
    q = Path(p)
    return q if q.is_absolute() else base / q


def ray_resources(exp: Experiment) -> dict:
    """What each node's part asks of Ray: the node actor itself asks for nothing (its sandboxes and
    proxies are processes it starts); the node must have CPUs for them."""
    r, f = exp.rollout, exp.fleet
    per_node = r.get("concurrency", 1) * f.get("cpus_per_sandbox", 1) + f.get("proxies_per_node", 1)
    return {"nodes": f.get("nodes", 1), "per_node": {"CPU": per_node}, "actor": {"num_cpus": 0},
            "placement": "one RolloutNode per node, hard NodeAffinitySchedulingStrategy"}


def plan(exp: Experiment) -> list[str]:
    """The plan, as lines: the commands that run the experiment on a cluster, one fleet per harness."""
    r, f, t, s = exp.rollout, exp.fleet, exp.trainer, exp.server
    res = ray_resources(exp)
    tasks = f"--tasks {r['tasks']}" if "tasks" in r else f"--swebench {r['swebench']} --repos {r['repos']}"
    n = r.get("_n_tasks")
    lines = [f"experiment {exp.name} ({exp.path})",
             f"model {exp.model['hf_id']} served as {exp.model['served_name']!r} by {s['engine']} at {s['url']}"]
    if s.get("command"):
        lines.append("  server: " + " ".join(s["command"]))
    lines.append(f"tasks: {n if n is not None else '?'} x {r.get('samples', 1)} samples x {len(r['harnesses'])} "
                 f"harnesses ({', '.join(r['harnesses'])})")
    lines.append(f"fleet: {res['nodes']} nodes x ({r.get('concurrency', 1)} sandboxes + {f.get('proxies_per_node', 1)} "
                 f"proxies): each node needs {res['per_node']}; {res['placement']}")
    for h in r["harnesses"]:
        store = harness_store(exp, h)
        lines.append(f"  polar-rollout fleet --recipe {h} {tasks} --samples {r.get('samples', 1)} "
                     f"--server {s['url']} --model {exp.model['served_name']} --store {store} "
                     f"--ray-address {f['ray_address']} --proxies-per-node {f.get('proxies_per_node', 1)} "
                     f"--runtime {r.get('runtime', 'local')} --concurrency {r.get('concurrency', 1)} "
                     f"--prewarm {r.get('prewarm', 1)} --eval-concurrency {r.get('eval_concurrency', 1)} "
                     f"--max-attempts {f.get('max_attempts', 3)}")
    launch = (["accelerate", "launch", *t.get("launcher_args", []), "-m", "trainer.train_grpo"]
              if t["launcher"] == "accelerate" else ["python", "-m", "trainer.train_grpo"])
    flags = " ".join(f"--{k} {v}" for k, v in t["args"].items())
    lines.append(f"trainer: {' '.join(launch)} --shards {f['store'].rstrip('/')}/<harness>/shards {flags}")
    lines += [f"NOT CHECKED HERE: {note}" for note in exp.notes]
    return lines


def harness_store(exp: Experiment, harness: str) -> str:
    """Each harness's own store prefix: <store>/<recipe name> (a recipe given as a path: its name)."""
    return f"{exp.fleet['store'].rstrip('/')}/{load_recipe(harness).name}"


def fleet_runs(exp: Experiment, node_dir: str = "") -> list[dict]:
    """What ``polar-rollout fleet --config FILE`` runs: one fleet per harness, one after the other on
    the same cluster, each into its own store prefix ``<store>/<harness>`` (as ``plan`` prints them).
    Each: ``harness``, ``tasks`` (loaded here: the file must be on this machine), ``node`` (the
    NodeConfig fields) and ``max_attempts``."""
    r, f = exp.rollout, exp.fleet
    base = exp.path.parent
    try:
        if "tasks" in r:
            swe = is_swebench_spec(r["tasks"])  # swebench:FILE, as _check_rollout reads it
            path = _resolve(base, r["tasks"][len(PREFIX):] if swe else r["tasks"])
            tasks = load_instances(path) if swe else load_tasks(path)
        else:
            tasks = load_swebench(_resolve(base, r["swebench"]), _resolve(base, r["repos"]))
    except (TaskError, FileNotFoundError, OSError) as exc:
        raise ExperimentError(f"{exp.path} [rollout]: the tasks cannot be loaded on this machine: {exc}") from None
    runtime = r.get("runtime", "local")
    opts = {"isolation": r.get("isolation", "auto")} if runtime == "local" else {}
    out = []
    for h in r["harnesses"]:
        node = {"recipe": h, "server": exp.server["url"], "store": harness_store(exp, h),
                "model": exp.model["served_name"], "proxies": f.get("proxies_per_node", 1), "runtime": runtime,
                "runtime_opts": opts, "node_dir": node_dir, "samples": r.get("samples", 1),
                "limits": {"prewarm": r.get("prewarm", 1), "run": r.get("concurrency", 1),
                           "eval": r.get("eval_concurrency", 1)}}
        out.append({"harness": h, "tasks": tasks, "node": node, "max_attempts": f.get("max_attempts", 3)})
    return out
