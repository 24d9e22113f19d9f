"""`polar-rollout`: run a harness recipe over tasks through the capture proxy, pipelined.

    polar-rollout run --recipe pi --tasks data/tasks/tasks.jsonl --samples 2 \\
        --proxy http://127.0.0.1:8080 --logdir LOGDIR --out OUT [--runtime local|docker]
    polar-rollout run --recipe codex --tasks swebench:data/swebench/mini.jsonl --runtime docker \\
        [--instances ID,ID] [--limit N] ...      # SWE-bench instances, graded by swebench
    polar-rollout fleet --recipe pi --tasks data/tasks/tasks.jsonl --samples 2 \\
        --server http://inference:8000 --store file:///shared/run --ray-address auto   # fleet/driver.py
    polar-rollout recipes          # the bundled recipes (--recipe NAME), or --recipe PATH.toml
    polar-rollout install NAME     # install a recipe's CLI into the harness cache
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import click

import harness_recipes.node.episode as ep
from harness_recipes.attacks.suite import Deployment, run_suite, table
from harness_recipes.fleet.driver import Cluster, NodeConfig, run_fleet
from harness_recipes.fleet.experiment import ExperimentError, fleet_runs, load_experiment, plan
from harness_recipes.fleet.queue import plan_groups
from harness_recipes.fleet.store import Store, StoreError
from harness_recipes.node.processes import stop
from harness_recipes.node.progress import FleetView, Progress, summary_table
from harness_recipes.node.proxy_control import ProxyControlError, check_proxy
from harness_recipes.node.records import Records
from harness_recipes.node.run_metrics import REPORT_TO, RunMetrics, open_writer
from harness_recipes.node.scheduler import Limits, Pipeline
from harness_recipes.node.upstream import model_mismatch, served_models
from harness_recipes.recipes.install import ensure_installed, installed_version, spec_of
from harness_recipes.recipes.limits import Limits as SandboxLimits
from harness_recipes.recipes.limits import human, parse_limits
from harness_recipes.recipes.recipe import RecipeError, bundled_names, load_recipe
from harness_recipes.runtimes import make_runtime
from harness_recipes.runtimes.file_tree import Budget
from harness_recipes.tasks.swebench.instances import is_swebench_spec, load_instances
from harness_recipes.tasks.task_file import TaskError, load_swebench, load_tasks
from polar_contracts.control import OPEN, new_secret, read_secret_file, write_secret_file
from trainer.ray_join import RayJoinError


def _default(name: str) -> str:
    value = getattr(SandboxLimits(), name)
    return human(value) if name in ("memory", "disk") else str(value)


def _limit_option(ctx, param, value):
    """Keeps a sandbox limit given on the command line in ctx.meta (read by _runtime_opts), checked now."""
    if value is not None:
        try:
            parse_limits({param.name: value}, f"--{param.name}")
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
        ctx.meta.setdefault("polar_limits", {})[param.name] = value
    return value


def runtime_options(f):
    """--runtime, --isolation and the sandbox limits, the same for run, fleet and attack."""
    for name, metavar, what in reversed([
            ("memory", "SIZE", "each sandbox's memory (RAM, no swap past it), e.g. 4g"),
            ("pids", "N", "processes and threads at once in each sandbox"),
            ("cpus", "CORES", "each sandbox's CPU share, in cores' worth of time, e.g. 2"),
            ("disk", "SIZE", "what each sandbox may write (workspace, home, /tmp, a container's layer), e.g. 8g")]):
        f = click.option(f"--{name}", metavar=metavar, default=None, expose_value=False, callback=_limit_option,
                         help=f"{what}; 0: no limit [default: the recipe's [limits], else {_default(name)}]. "
                              + ("A sandbox past it is slowed down, never stopped" if name == "cpus" else
                                 "A sandbox that reaches it is stopped: the episode ends as resource_limit"))(f)
    f = click.option("--isolation", type=click.Choice(["auto", "bwrap", "none"]), default="auto", show_default=True,
                     help="local runtime: bubblewrap sandbox (auto refuses to start without one); none: UNSANDBOXED, "
                          "every episode marked so. The docker runtime is always isolated (--network none)")(f)
    return click.option("--runtime", type=click.Choice(["local", "docker"]), default="local", show_default=True)(f)


def parse_budget(text: str | None) -> Budget:
    """--grading-budget KEY=VALUE,...: file_tree.Budget's fields (sizes in bytes, seconds), the rest default."""
    if not text:
        return Budget()
    known = [f.name for f in dataclasses.fields(Budget)]
    values = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or key not in known:
            raise click.UsageError(f"--grading-budget: {item.strip()!r} is not KEY=VALUE with KEY one of "
                                   f"{', '.join(known)}")
        try:
            values[key] = float(value) if key == "seconds" else int(value)
        except ValueError:
            raise click.UsageError(f"--grading-budget: {key}={value!r} is not a number") from None
    try:
        return Budget(**values)
    except ValueError as e:
        raise click.UsageError(f"--grading-budget: {e}") from None


def budget_option(f):
    """--grading-budget, the same for run and attack."""
    return click.option("--grading-budget", "grading_budget", default=None, metavar="KEY=VALUE,...",
                        help="bounds on grading: max_patch_files, max_patch_bytes, max_tree_files, max_tree_bytes, "
                             "max_file_bytes, seconds (defaults: runtimes/file_tree.py Budget); a patch over one "
                             "is graded 0 with the reason")(f)


def _user_pythons(ctx, _param, values):
    """--python X.Y=DIR (repeatable), checked now: kept in the command's context for the task loader."""
    from harness_recipes.tasks.swebench.pythons import PythonError, parse_pythons
    try:
        ctx.meta["polar_pythons"] = parse_pythons(values)
    except PythonError as e:
        raise click.BadParameter(str(e)) from None


PYTHON_OPTION = click.option(
    "--python", "pythons", multiple=True, metavar="X.Y=DIR", expose_value=False, callback=_user_pythons,
    help="with swebench tasks: a relocatable CPython X.Y build (DIR/bin/pythonX.Y) for the specs whose Python "
         "no Debian suite here ships (3.9 and 3.11 come from Debian); repeatable")


def _pythons() -> dict[str, str] | None:
    ctx = click.get_current_context(silent=True)
    return (ctx.meta.get("polar_pythons") or None) if ctx is not None else None


def task_options(f):
    """The task options `run` and `fleet` share (the same task files on one machine or a fleet)."""
    for opt in reversed([
        click.option("--tasks", "tasks_path", help="tasks JSONL, or swebench:FILE (SWE-bench instances: JSONL, "
                     "Parquet, or a datasets dataset saved to disk)"),
        click.option("--swebench", type=click.Path(dir_okay=False), help="SWE-bench-style instances JSONL (local file)"),
        click.option("--repos", type=click.Path(file_okay=False),
                     help="with swebench tasks: directory of local clones owner__name (else data/ sources or the image)"),
        click.option("--instances", default=None, metavar="ID,ID", help="with --tasks swebench:FILE: only these ids"),
        click.option("--limit", default=None, type=click.IntRange(1),
                     help="with --tasks swebench:FILE: the first N instances"),
        PYTHON_OPTION,
        click.option("--samples", default=1, show_default=True, type=click.IntRange(1),
                     help="episodes per task (GRPO group)")]):
        f = opt(f)
    return f


@click.group()
def main() -> None:
    """Polar's rollout node: harness recipes, runtimes, the pipelined episode runner."""


@main.command()
@click.option("--recipe", required=True, help="recipe file or bundled name (pi, qwen-code, codex, claude-code, ...)")
@task_options
@click.option("--proxy", required=True, help="capture proxy URL, e.g. http://127.0.0.1:8080")
@click.option("--control-secret-file", type=click.Path(dir_okay=False), default=None,
              help="the file holding the proxy's control secret (the proxy's polar_control_secret_file, mode "
                   "0600): episodes are ended with it and harnesses get capabilities; without it the proxy must "
                   "have an open control plane")
@click.option("--unsafe-open-proxy", is_flag=True,
              help="run against a proxy with an OPEN control plane (no control secret: the agent could end its own "
                   "episode with any reward); refused without this flag. Every row is marked control_plane=open")
@click.option("--logdir", required=True, type=click.Path(file_okay=False), help="the proxy's polar_logdir")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="shards + rollout records")
@runtime_options
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(1), help="harness runs at once")
@click.option("--prewarm", default=2, show_default=True, type=click.IntRange(1), help="workspaces prepared ahead")
@click.option("--eval-concurrency", default=2, show_default=True, type=click.IntRange(1),
              help="evaluations (grading in a fresh sandbox) at once")
@click.option("--sequential", is_flag=True, help="no pipelining: one episode through all phases at a time")
@click.option("--model", default="polar-model", show_default=True, help="model name the harness asks for")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="environment variable holding the API key the harness sends (never given on the command line)")
@click.option("--recon", type=click.Choice(["build", "watch", "none"]), default="build", show_default=True,
              help="build shards at the end, run polar-recon watch alongside, or leave it to the user")
@click.option("--keep-workspaces", is_flag=True, help="leave episode directories for inspection (local runtime)")
@click.option("--no-progress", is_flag=True, help="plain log lines instead of the live view")
@click.option("--report-to", type=click.Choice(REPORT_TO), default="none", show_default=True,
              help="where the run's metrics go while it runs (TRL's report_to names; harness_recipes/node/"
                   "run_metrics.py): tensorboard writes event files into --logging-dir; wandb logs a W&B run "
                   "(needs `pip install wandb`; WANDB_PROJECT, WANDB_MODE=offline apply)")
@click.option("--logging-dir", type=click.Path(file_okay=False), default=None,
              help="with --report-to: the event directory, or where W&B keeps its files [default: OUT/runs]")
@budget_option
def run(recipe, tasks_path, swebench, repos, instances, limit, samples, proxy, control_secret_file, unsafe_open_proxy,
        logdir, out, runtime, isolation, concurrency, prewarm, eval_concurrency, sequential, model, api_key_env, recon,
        keep_workspaces, no_progress, report_to, logging_dir, grading_budget) -> None:
    """Run SAMPLES episodes per task and record each one's status; restarting skips finished ones."""
    # A relative --out / --logdir is relative to where the command was run, once: sandboxes, git and
    # the grader run in other working directories.
    out, logdir = Path(out).resolve(), Path(logdir).resolve()
    rec, tasks, settings = _episode_setup(recipe, (tasks_path, swebench, repos, instances, limit), runtime, proxy,
                                          model, control_secret_file, api_key_env)
    settings.grading_budget = parse_budget(grading_budget)
    _check_proxy_control(settings, unsafe_open_proxy)
    _check_model(settings)
    exe = ensure_installed(rec, log=lambda m: click.echo(m, err=True))
    # Episode directories live under OUT, not /tmp: Codex refuses to set up its helpers under a temp dir.
    work = out / "rollout" / "work"
    work.mkdir(parents=True, exist_ok=True)
    opts = _runtime_opts(runtime, isolation, keep=keep_workspaces)
    limits = Limits(prewarm=prewarm, run=concurrency, eval=eval_concurrency, sequential=sequential)
    metrics = _metrics_writer(report_to, Path(logging_dir or out / "runs").resolve(), out, rec, tasks, samples)
    try:
        rt = make_runtime(runtime, workdir=str(work), recipe_limits=rec.limits, **opts)
        code = asyncio.run(_run(rec, exe, rt, tasks, samples, settings,
                                logdir, out, limits, recon, not no_progress, metrics))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, or SIGTERM (see _cancel_on_sigterm)
        click.echo("polar-rollout: interrupted; running episodes were stopped and recorded as 'interrupted'. "
                   "Run the same command again to resume.", err=True)
        sys.exit(130)
    except RuntimeError as e:  # e.g. dockerd not reachable, bubblewrap asked for but unusable
        raise click.ClickException(str(e)) from None
    sys.exit(code)


@main.command()
@click.option("--config", "config", type=click.Path(dir_okay=False),
              help="an experiment file (harness_recipes/fleet/experiments/*.toml) instead of the options below")
@click.option("--dry-run", is_flag=True, help="with --config: check it here and print the plan; start nothing "
                                              "(without it: run the plan's fleets, one per harness; --local N to try "
                                              "it on this machine)")
@click.option("--recipe", help="recipe file or bundled name (the same on every node)")
@task_options
@click.option("--server", help="the inference server every node's proxies forward to")
@click.option("--store", help="filesystem URI the fleet shares (file:///..., s3://...): logs, "
                                             "rollout records, shards")
@click.option("--ray-address", default=None, help="Ray cluster to join: auto | HOST:PORT")
@click.option("--local", "local_nodes", type=click.IntRange(1), default=None,
              help="start N Ray nodes on this machine instead (a try-out)")
@click.option("--proxies-per-node", type=click.IntRange(1), default=None,
              help="capture proxies on each node [default: one per core]")
@click.option("--max-attempts", default=3, show_default=True, type=click.IntRange(1),
              help="attempts of a group whose node dies before it is given up")
@click.option("--node-dir", default="", help="working directory on each node [default: $TMPDIR/polar-fleet]")
@click.option("--resume", is_flag=True, help="continue the run the store holds: skip finished episodes, retry the rest")
@runtime_options
@click.option("--concurrency", default=2, show_default=True, type=click.IntRange(1), help="harness runs at once per node")
@click.option("--prewarm", default=2, show_default=True, type=click.IntRange(1), help="workspaces prepared ahead")
@click.option("--eval-concurrency", default=2, show_default=True, type=click.IntRange(1),
              help="evaluations (grading in a fresh sandbox) at once per node")
@click.option("--model", default="polar-model", show_default=True, help="model name the harness asks for")
@click.option("--api-key-env", default=None, metavar="VAR",
              help="environment variable holding the API key the harness sends (never given on the command line)")
@click.option("--no-progress", is_flag=True, help="plain log lines instead of the live view")
def fleet(config, dry_run, recipe, tasks_path, swebench, repos, instances, limit, samples, server, store, ray_address,
          local_nodes, proxies_per_node, max_attempts, node_dir, runtime, isolation, concurrency, prewarm,
          eval_concurrency, model, api_key_env, no_progress, resume) -> None:
    """Run SAMPLES episodes per task on every node of a Ray cluster, each node with its own proxies
    and pipeline, all feeding one store."""

    if config or dry_run:
        if dry_run or not config:
            _experiment(config, dry_run)
            return
        given = [f"--{n}" for n, v in (("recipe", recipe), ("tasks", tasks_path), ("swebench", swebench),
                                       ("server", server), ("store", store), ("ray-address", ray_address)) if v]
        if given:
            raise click.UsageError(f"--config FILE says what {', '.join(given)} would: give one or the other")
        _run_experiment(config, local_nodes, node_dir, resume, no_progress)
        return
    if not (recipe and server and store):
        raise click.UsageError("give --recipe, --server and --store (or --config FILE)")
    if (ray_address is None) == (local_nodes is None):
        raise click.UsageError("give exactly one of --ray-address (auto | HOST:PORT) and --local N")
    try:
        load_recipe(recipe)
        tasks = _tasks(tasks_path, swebench, repos, instances, limit)
        Store(store)
    except (RecipeError, TaskError, StoreError) as e:
        raise click.UsageError(str(e)) from None
    _check_runtime(tasks, runtime)
    api_key = None
    if api_key_env:
        api_key = os.environ.get(api_key_env)
        if not api_key:
            raise click.UsageError(f"--api-key-env {api_key_env}: that variable is not set or empty")
    opts = _runtime_opts(runtime, isolation)
    cfg = NodeConfig(recipe=recipe, server=server, store=store, model=model, api_key=api_key,
                     proxies=proxies_per_node, runtime=runtime, runtime_opts=opts, node_dir=node_dir, samples=samples,
                     limits={"prewarm": prewarm, "run": concurrency, "eval": eval_concurrency})
    ok = _fleets([(cfg, tasks, max_attempts)], ray_address, local_nodes, resume, no_progress)
    sys.exit(0 if ok else 3)


def _fleets(runs, ray_address, local_nodes, resume, no_progress) -> bool:
    """Run each (NodeConfig, tasks, max_attempts) as one fleet, one after the other, on one Ray
    connection; their summaries as lines. True when every fleet finished with nothing given up."""

    todo = []
    for cfg, tasks, max_attempts in runs:  # every store checked before anything starts
        try:
            records = Store(cfg.store).records()
        except StoreError as e:
            raise click.UsageError(str(e)) from None
        if records and not resume:
            raise click.UsageError(f"--store {cfg.store} already holds {len(records)} rollout records: pass --resume "
                                   "to continue that run (finished episodes are skipped), or give a new --store")
        groups, skipped = plan_groups(tasks, cfg.samples, records)
        if skipped:
            click.echo(f"polar-fleet: {skipped} episodes finished before, skipped", err=True)
        if groups:
            todo.append((cfg, groups, max_attempts))
        else:
            click.echo(f"polar-fleet: nothing left to run for {cfg.recipe} ({cfg.store})")
    if not todo:
        return True
    try:
        import ray  # noqa: F401
    except ImportError:
        raise click.ClickException("polar-rollout fleet needs Ray: pip install 'polar[fleet]'") from None
    ok = True
    try:
        with Cluster(address=ray_address if local_nodes is None else None, local=local_nodes):
            for cfg, groups, max_attempts in todo:
                view = FleetView(enabled=not no_progress)
                with view:
                    res = run_fleet(cfg, groups, max_attempts=max_attempts, on_stats=view.update)
                store = cfg.store
                click.echo(f"polar-fleet: {res.episodes} episodes on {len(res.nodes)} nodes in {res.seconds:.1f} s "
                           f"({res.episodes / max(res.seconds, 1e-9):.2f}/s); groups {res.queue['groups']}; "
                           f"store {store}")
                if res.shards.get("built"):
                    click.echo(f"polar-fleet: shards in {res.shards['path']} ({len(res.shards['files'])} files)")
                else:
                    click.echo(f"polar-fleet: shards not built: {res.shards.get('why')}", err=True)
                for name, why in res.lost.items():
                    click.echo(f"polar-fleet: node {name} was lost: {why[:300]}", err=True)
                ok = ok and res.queue["finished"] and not res.queue["groups"].get("given up")
    except RayJoinError as e:  # raised by joining only, before anything runs
        raise click.ClickException(f"--ray-address: {e}") from None
    return ok


def _run_experiment(config, local_nodes, node_dir, resume, no_progress) -> None:
    """``--config FILE`` without ``--dry-run``: the plan's fleets, one per harness (experiment.fleet_runs)."""
    try:
        exp = load_experiment(config)
        runs = fleet_runs(exp, node_dir)
    except ExperimentError as e:
        raise click.UsageError(str(e)) from None
    for line in exp.notes:
        click.echo(f"polar-fleet: not checked here: {line}", err=True)
    ok = _fleets([(NodeConfig(**r["node"]), r["tasks"], r["max_attempts"]) for r in runs],
                 exp.fleet["ray_address"], local_nodes, resume, no_progress)
    sys.exit(0 if ok else 3)


def _experiment(config, dry_run) -> None:
    if not config:
        raise click.UsageError("--dry-run needs --config FILE")
    try:
        exp = load_experiment(config)
    except ExperimentError as e:
        raise click.UsageError(str(e)) from None
    for line in plan(exp):
        click.echo(line)


def _episode_setup(recipe, task_args, runtime, proxy, model, control_secret_file, api_key_env=None):
    """(recipe, tasks, node settings) of `run` and `attack`, every bad option a usage error."""
    try:
        rec = load_recipe(recipe)
        tasks = _tasks(*task_args)
    except (RecipeError, TaskError) as e:
        raise click.UsageError(str(e)) from None
    _check_runtime(tasks, runtime)
    settings = ep.Settings(proxy=proxy, model=model)
    if control_secret_file:
        try:
            settings.control_secret = read_secret_file(control_secret_file)
        except ValueError as e:
            raise click.UsageError(f"--control-secret-file: {e}") from None
    if api_key_env:
        if not os.environ.get(api_key_env):
            raise click.UsageError(f"--api-key-env {api_key_env}: that variable is not set or empty")
        settings.api_key = os.environ[api_key_env]
    return rec, tasks, settings


def _runnable(tasks):
    """The instances that can run here (an official image in the local docker, or buildable): the
    others are refused up front, each with its reason (`polar-rollout swebench plan` says the same)."""
    from harness_recipes.tasks.swebench.plan import docker_client, plan
    decisions = plan(tasks, docker_client())
    refused = {d.instance_id: d.reason for d in decisions if d.path == "refused"}
    for iid, why in refused.items():
        click.echo(f"polar-rollout: refused {iid}: {why}", err=True)
    kept = [t for t in tasks if t.swebench["instance_id"] not in refused]
    if not kept:
        raise TaskError(f"every instance was refused ({len(refused)}): see the reasons above, or "
                        "`polar-rollout swebench plan FILE`")
    return kept


@main.group()
def swebench() -> None:
    """SWE-bench instances: what can run here."""


@swebench.command("plan")
@click.argument("file")
@click.option("--repos", type=click.Path(file_okay=False), default=None,
              help="directory of local repositories owner__name (clones or .bundle) and requirements/")
@click.option("--instances", default=None, metavar="ID,ID", help="only these ids")
@click.option("--limit", default=None, type=click.IntRange(1), help="the first N instances")
@click.option("--json", "as_json", is_flag=True, help="JSON instead of the Markdown table")
@PYTHON_OPTION
def swebench_plan(file, repos, instances, limit, as_json) -> None:
    """Per instance: official image / buildable here / refused (with the reason), and the totals.
    Reads the rows, the local repositories and the local docker's images: nothing from the network."""
    from harness_recipes.tasks.swebench import plan as planner
    ids = [i.strip() for i in instances.split(",") if i.strip()] if instances else None
    try:
        tasks = load_instances(file, repos=repos, instances=ids, limit=limit, pythons=_pythons())
    except TaskError as e:
        raise click.UsageError(str(e)) from None
    client = planner.docker_client()
    decisions = planner.plan(tasks, client)
    click.echo(planner.as_json(decisions, client is not None) if as_json
               else planner.table(decisions, client is not None), nl=False)


@swebench.command("specs")
def swebench_specs() -> None:
    """Per repo and version of SWE-bench's spec tables: buildable here, or why not (no rows needed)."""
    from harness_recipes.tasks.swebench.plan import spec_table
    click.echo(spec_table(), nl=False)


def _check_proxy_control(settings: ep.Settings, allow_open: bool) -> None:
    """Refuse an open proxy (node/proxy_control.py) before any episode runs; record what it is."""
    try:
        control = check_proxy(settings.proxy, settings.control_secret, allow_open)
    except ProxyControlError as e:
        raise click.ClickException(str(e)) from None
    if control is None:
        click.echo(f"polar-rollout: could not reach the capture proxy at {settings.proxy} to check its control "
                   f"plane; episodes will fail until it answers", err=True)
    elif control == OPEN:
        click.echo("polar-rollout: WARNING: the capture proxy's control plane is OPEN (--unsafe-open-proxy): the "
                   "agent could end its own episode with any reward; every row is marked control_plane=open", err=True)
    settings.control_plane = control if control is not None else settings.control_plane


def _check_model(settings: ep.Settings) -> None:
    """Refuse a --model the server does not serve before any episode (node/upstream.py)."""
    served = served_models(settings.proxy, settings.control_secret)
    if served is None:
        click.echo(f"polar-rollout: could not read the served models through {settings.proxy} (GET /v1/models); "
                   f"not checked that the server serves --model {settings.model}", err=True)
        return
    why = model_mismatch(settings.model, served)
    if why:
        raise click.ClickException(why)


def _runtime_opts(runtime: str, isolation: str, keep: bool = False) -> dict:
    # The sandbox limits given on the command line (runtime_options), over the recipe's [limits]
    # (make_runtime's recipe_limits) over the defaults.
    ctx = click.get_current_context(silent=True)
    limits = dict(ctx.meta.get("polar_limits", {})) if ctx is not None else {}
    extra = {"limits": limits} if limits else {}
    if runtime == "local":
        return {"isolation": isolation, "keep": keep, **extra} if keep else {"isolation": isolation, **extra}
    if isolation == "none":
        raise click.UsageError("--runtime docker is always isolated (--network none); to run unsandboxed, "
                               "use --runtime local --isolation none")
    return extra


def _check_runtime(tasks, runtime: str) -> None:
    if runtime != "docker" and any(t.swebench is not None for t in tasks):
        raise click.UsageError("SWE-bench instances run in their images: add --runtime docker")


def _tasks(tasks_path, swebench, repos, instances=None, limit=None):
    if bool(tasks_path) == bool(swebench):
        raise TaskError("give exactly one of --tasks or --swebench")
    if tasks_path and is_swebench_spec(tasks_path):
        ids = [i.strip() for i in instances.split(",") if i.strip()] if instances else None
        return _runnable(load_instances(tasks_path, repos=repos, instances=ids, limit=limit, pythons=_pythons()))
    if instances or limit:
        raise TaskError("--instances / --limit select SWE-bench instances: use them with --tasks swebench:FILE")
    if swebench:
        if not repos:
            raise TaskError("--swebench needs --repos DIR (local clones named owner__name)")
        return load_swebench(swebench, repos)
    return load_tasks(tasks_path)


def _metrics_writer(report_to: str, logging_dir: Path, out: Path, recipe, tasks, samples: int):
    """(writer, where) for --report-to, opened before any episode runs; None for none. A backend that
    cannot start (wandb not installed, no login) stops the run here with the reason (exit 2)."""
    from harness_recipes.node.wandb_run import MetricsBackendError

    config = {"recipe": recipe.name, "tasks": len(tasks), "samples": samples, "out": out.name}
    try:
        writer, where = open_writer(report_to, logging_dir, name=out.name, config=config)
    except MetricsBackendError as exc:
        raise click.UsageError(str(exc)) from None
    return None if writer is None else (writer, where)


async def _run(recipe, exe, runtime, tasks, samples, settings, logdir: Path, out: Path, limits, recon, progress,
               metrics_writer=None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    logdir.mkdir(parents=True, exist_ok=True)
    records = Records(out)
    # Reconstruction reads this run's logs only (OUT/rollout/logs, linked as each episode is handed
    # off), never what other runs left in the same proxy logdir.
    records.logs.mkdir(exist_ok=True)
    pipeline = Pipeline(recipe, exe, runtime, settings, records, logdir, limits, link_logs=True)
    pipeline.plan(tasks, samples)
    _cancel_on_sigterm()
    watcher = _start_watch(records.logs, out, samples) if recon == "watch" else None
    view = Progress(enabled=progress)
    pipeline.on_change = view.update
    metrics = None
    if metrics_writer is not None:
        writer, where = metrics_writer
        metrics = RunMetrics(writer, logdir)
        click.echo(f"polar-rollout: {where}", err=True)
        pipeline.on_change = lambda p: (view.update(p), metrics.update(p))
    try:
        with view:
            await pipeline.run()
    finally:
        await runtime.shutdown()
        if metrics is not None:
            metrics.close()
        if watcher is not None:
            stop(watcher, signal.SIGINT, grace=30)  # watch finishes the shard it is writing and exits 0
    view.console.print(summary_table(pipeline, title=f"polar-rollout: {recipe.name}"))
    code = 0
    if recon in ("build", "watch"):
        # After watch: one last build picks up what finished after its last scan (build skips
        # episodes already in OUT).
        if any(records.logs.glob("*.arrow")):
            code = _build(records.logs, out)
        else:
            view.console.print(f"no episode logs in {records.logs}: nothing to build")
    errors = pipeline.stats.statuses.get(ep.ERROR, 0)
    if errors:
        view.console.print(f"{errors} episode(s) ended in 'error' (see {out}/rollout/episodes.jsonl); "
                           "run the same command again to retry them.")
        code = code or 3
    return code


def _cancel_on_sigterm() -> None:
    # SIGTERM gets the same orderly shutdown as Ctrl-C: every episode records its status.
    task = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


def _start_watch(logdir: Path, out: Path, samples: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "polar_recon.cli", "watch", str(logdir), str(out),
                             "--group-size", str(samples), "--poll", "1"])


def _build(logdir: Path, out: Path) -> int:
    proc = subprocess.run([sys.executable, "-m", "polar_recon.cli", "build", str(logdir), str(out)])
    if proc.returncode != 0:
        click.echo(f"polar-recon build {logdir} {out} failed ({proc.returncode})", err=True)
    return proc.returncode


@main.command()
@click.option("--recipe", required=True, help="the recipe whose environment and config files the agent gets")
@task_options
@click.option("--proxy", required=True, help="capture proxy URL the harness would use, e.g. http://127.0.0.1:8080")
@click.option("--control-secret-file", type=click.Path(dir_okay=False), default=None,
              help="the proxy's control secret (as for `run`); without it the suite reports the open control plane")
@click.option("--server", default=None, help="the inference server (its weight version is checked when it is polar-serve)")
@click.option("--logdir", required=True, type=click.Path(file_okay=False), help="the proxy's polar_logdir")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="where the suite's records go")
@runtime_options
@click.option("--model", default="polar-model", show_default=True)
@click.option("--checkout", type=click.Path(file_okay=False), default=None,
              help="a directory of yours the agent must not read (canary planted there) [default: the current one]")
@click.option("--via-harness", is_flag=True,
              help="keep the harness's own command: its model must make it run the agent (a scripted server whose "
                   "shell tool call is harness_recipes.attacks.suite.AGENT_COMMAND)")
@click.option("--json", "as_json", is_flag=True, help="one JSON object per attack instead of the table")
@budget_option
def attack(recipe, tasks_path, swebench, repos, instances, limit, samples, proxy, control_secret_file, server, logdir,
           out, runtime, isolation, model, checkout, via_harness, as_json, grading_budget) -> None:
    """Attack your own deployment as a reward-hacking agent would, from inside its sandbox.

    Two episodes of the first task run the recipe's environment and config files with the
    adversarial agent (harness_recipes/attacks/agent.py) in place of the harness. Each attack's
    verdict is read from outside the sandbox. Exit status 1 when any attack was not stopped."""
    out, logdir = Path(out).resolve(), Path(logdir).resolve()  # relative to where the command was run (as `run`)
    rec, tasks, settings = _episode_setup(recipe, (tasks_path, swebench, repos, instances, limit), runtime, proxy,
                                          model, control_secret_file)
    settings.grading_budget = parse_budget(grading_budget)
    exe = ensure_installed(rec, log=lambda m: click.echo(m, err=True))
    work = out / "rollout" / "work"
    work.mkdir(parents=True, exist_ok=True)
    Path(logdir).mkdir(parents=True, exist_ok=True)
    try:
        rt = make_runtime(runtime, workdir=str(work), recipe_limits=rec.limits, **_runtime_opts(runtime, isolation))
        verdicts = asyncio.run(run_suite(Deployment(rec, exe, rt, settings, tasks[0], Path(logdir), Path(out),
                                                    server=server, checkout=Path(checkout or os.getcwd()),
                                                    via_harness=via_harness)))
    except RuntimeError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        for v in verdicts:
            click.echo(json.dumps({"attack": v.attack, "stopped": v.stopped, "evidence": v.evidence}))
    else:
        click.echo(table(verdicts))
    sys.exit(0 if all(v.stopped for v in verdicts) else 1)


@main.command()
@click.argument("recipe")
def install(recipe) -> None:
    """Install a recipe's harness CLI into the harness cache and print its --version.

    The cache: $POLAR_HARNESS_CACHE, else $POLAR_CACHE/harnesses, else ~/.cache/polar/harnesses
    (`make` sets POLAR_CACHE to the checkout's .cache/)."""
    try:
        r = load_recipe(recipe)
    except RecipeError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"{r.name}: {ensure_installed(r)} ({installed_version(r)})")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
def secret(file) -> None:
    """Write a fresh control secret to FILE (mode 0600) for the proxy (polar_control_secret_file)
    and `run --control-secret-file`. A FILE that already holds a valid secret is kept, so running
    it twice is harmless; anything else there is an error, never overwritten."""
    path = Path(file)
    if path.exists() or path.is_symlink():
        try:
            read_secret_file(path)
        except ValueError as e:
            raise click.ClickException(f"{e}; not overwritten: remove it, or give another FILE") from None
        click.echo(f"{file}: already holds a control secret, kept")
        return
    if not path.parent.is_dir():
        raise click.ClickException(f"{path.parent}: no such directory (create it, or give FILE in an existing one)")
    write_secret_file(path, new_secret())
    click.echo(f"{file}: new control secret (mode 0600); start the proxy with --set polar_control_secret_file={file} "
               f"and pass --control-secret-file {file} to polar-rollout run")


@main.command()
def recipes() -> None:
    """List the bundled recipes: name, API, pinned package, description."""
    for name in bundled_names():
        r = load_recipe(name)
        spec = spec_of(r) if r.install.kind != "none" else f"{r.install.bin} (on PATH)"
        click.echo(f"{name:16} {r.api:12} {spec:40} {r.description}")


@main.command()
@click.argument("out", type=click.Path(exists=True, file_okay=False))
def summary(out) -> None:
    """Print the recorded episodes of OUT as JSON lines (last record per episode)."""
    for rec in Records(Path(out)).latest.values():
        click.echo(json.dumps(rec, sort_keys=True))


if __name__ == "__main__":
    main()
