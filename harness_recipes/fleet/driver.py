"""`polar-rollout fleet`: the rollout node of `run`, on every node of a Ray cluster.

    driver (polar-rollout fleet)             Ray node 1 .. N
      TaskQueue actor (fleet/queue.py)  <--  RolloutNode actor: K capture proxies (proxies.py) in front
      WeightsCoordinator actor               of --server, the pipelined phases of `run` (scheduler.py),
      recon: polar-recon watch over the      each finished episode's log + record -> the store
        store's logs -> <store>/shards       (store.py)
        (fleet/recon.py)
      live view of every node

Placement is Ray's: one RolloutNode per alive node, pinned with a hard NodeAffinitySchedulingStrategy
(exactly one per node, and the node id is the actor's name in the records; a STRICT_SPREAD
placement group would give the same spread but needs a bundle per node and fails whole when one
node is short). The actors ask for no CPUs: the harnesses, proxies and sandboxes they start are
ordinary processes, not Ray tasks, so Ray's CPU accounting stays free for anything else.

Nodes pull whole GRPO groups from the queue when they have free slots (work stealing). Ray is
imported only here and only when a fleet runs (``pip install polar[fleet]``).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import harness_recipes.node.episode as ep
from addon.weight_hold import urllib_http
from harness_recipes.fleet.queue import Group, WorkQueue
from harness_recipes.fleet.ray_auth import token_auth
from harness_recipes.fleet.recon import make_recon
from harness_recipes.fleet.store import LOGS, RECORDS, STAGING, Store
from harness_recipes.node.proxies import (
    DEFAULT_LEASE_S,
    SyncResult,
    coordinate,
    hold_proxies,
    lead_sync,
    proxy_pool,
    release_proxies,
)
from harness_recipes.node.records import Records
from harness_recipes.node.scheduler import PHASES, Job, Limits, Pipeline
from harness_recipes.recipes.install import ensure_installed
from harness_recipes.recipes.recipe import load_recipe
from harness_recipes.runtimes import make_runtime
from polar_contracts.control import SYNC_PATH
from trainer.ray_join import join

POLL_S = 0.2  # how often an idle node asks the queue again


@dataclass
class NodeConfig:
    """What every node needs to run its share: sent to each RolloutNode actor."""
    recipe: str  # a bundled name or a recipe file path (the same on every node)
    server: str  # the inference server the node's proxies forward to
    store: str  # the shared filesystem URI
    model: str = "polar-model"
    api_key: str | None = None
    proxies: int | None = None  # per node; None: one per core of the node
    proxy_sets: dict = field(default_factory=dict)  # mitmproxy --set options of every proxy
    runtime: str = "local"
    runtime_opts: dict = field(default_factory=dict)
    limits: dict = field(default_factory=lambda: asdict(Limits()))
    node_dir: str = ""  # local working directory on each node ("": <tmp>/polar-fleet)
    samples: int = 1


QUEUE_ACTOR = "polar-fleet-queue"  # (namespace NAMESPACE) the fleet's queue, for tools and tests


class TaskQueue:
    """The Ray actor around WorkQueue (one per fleet, on the driver's node), and the one writer of
    what the fleet publishes: a node stages an episode's log in the store and asks ``publish``; the
    queue checks the attempt is still current (``WorkQueue.may_publish``) and moves the log into
    ``logs/`` and writes its record in the same call. The actor runs one call at a time, so a node
    declared lost (``node_lost``) can never publish after that, whatever it still believes: the
    check and the publish are one step, not a check the node makes and then acts on."""

    def __init__(self, groups: list[Group], max_attempts: int = 3, store: str | None = None):
        self.q = WorkQueue(groups, max_attempts)
        self.store = Store(store) if store else None
        self.refused: list[dict] = []  # the episodes a fenced node tried to publish

    def take(self, node: str, n: int) -> list[Group]:
        return self.q.take(node, n)

    def publish(self, key: str, sample: int, node: str, attempt: int, eid: str, record: dict,
                staged: str | None) -> str | None:
        """Publish one finished episode (``staged``: its log, staged in the store, or None when it
        has none): None when published, else why not (the staged log is removed)."""
        why = self.q.may_publish(key, sample, node, attempt)
        if why is not None:
            self.refused.append({"episode_id": eid, "node": node, "attempt": attempt, "why": why})
            if staged:
                with contextlib.suppress(OSError):
                    self.store.fs.delete_file(self.store.path(staged))
            return why
        if staged:
            dest = self.store.path(f"{LOGS}/{eid}.arrow")
            self.store.fs.move(self.store.path(staged), dest)
            record = {**record, "log": dest}
        self.store.put_json(f"{RECORDS}/{eid}.json", record)
        self.q.episode_done(key, sample, node, attempt)
        return None

    def finish(self, key: str, node: str, attempt: int) -> bool:
        return self.q.finish(key, node, attempt)

    def node_lost(self, node: str, published: list[tuple[str, int]] = ()) -> list[str]:
        return [g.key for g in self.q.node_lost(node, {tuple(p) for p in published})]

    def status(self) -> dict:
        return {"finished": self.q.finished, "groups": self.q.counts(), "taken": dict(self.q.taken),
                "lost": sorted(self.q.lost), "refused": list(self.refused)}


class RolloutNode:
    """One node's rollout: its proxies, runtime and pipeline; jobs come from the TaskQueue."""

    def __init__(self, name: str, cfg: NodeConfig):
        self.name, self.cfg = name, cfg
        self.pipeline: Pipeline | None = None
        self.started = time.time()
        self.published = 0
        self.note = "starting"
        self.urls: list[str] = []  # this node's proxies, while it runs
        self._control: dict[str, str] = {}  # the header carrying this node's proxies' control secret
        self.proxy_pids: list[int] = []
        self.fenced: str | None = None  # why the queue refused this node's episode: it stops

    def where(self) -> dict:
        import ray
        return {"node": self.name, "ray_node_id": ray.get_runtime_context().get_node_id(),
                "host": socket.gethostname(), "pid": os.getpid()}

    def stats(self) -> dict:
        p = self.pipeline
        phases = dict(p.stats.phase_counts) if p else {ph: 0 for ph in PHASES}
        return {"node": self.name, "phases": phases, "finished": p.stats.finished if p else 0,
                "statuses": dict(p.stats.statuses) if p else {}, "published": self.published, "note": self.note,
                "proxy_pids": list(self.proxy_pids), "fenced": self.fenced, "pid": os.getpid()}

    async def run(self, queue) -> dict:
        cfg = self.cfg
        store = Store(cfg.store)
        recipe = load_recipe(cfg.recipe)
        exe = await asyncio.to_thread(ensure_installed, recipe)
        # one directory per store on each node: two fleets one after the other (--config's harnesses)
        # run the same episode ids, and a proxy refuses an id whose log it already holds
        store_key = hashlib.blake2b(cfg.store.encode(), digest_size=6).hexdigest()
        base = Path(cfg.node_dir or Path(os.environ.get("TMPDIR", "/tmp")) / "polar-fleet") / self.name / store_key
        logdir, out = base / "logs", base / "out"
        work = out / "rollout" / "work"
        work.mkdir(parents=True, exist_ok=True)
        limits = Limits(**cfg.limits)
        slots = limits.run + limits.prewarm
        where = self.where()
        self.note = "proxies"
        # die_with_parent: on a shared host the node's proxies must not outlive this actor's process
        # (its raylet killed, the actor killed): they would hold ports and write logs nobody publishes
        with proxy_pool(cfg.server, logdir, cfg.proxies, workdir=base / "proxies", sets=cfg.proxy_sets,
                        die_with_parent=True) as pool:
            self.urls, self.proxy_pids = pool.urls, [p.pid for p in pool.procs]
            # the pool's control secret stays in this actor: the coordinator reaches the proxies
            # through the weights_* methods below, over Ray, and never holds it
            self._control = pool.control_headers
            settings = ep.Settings(proxy=pool.urls[0], proxies=tuple(pool.urls), model=cfg.model,
                                   control_secret=pool.secret)
            if cfg.api_key:
                settings.api_key = cfg.api_key
            runtime = make_runtime(cfg.runtime, workdir=str(work), recipe_limits=recipe.limits, **cfg.runtime_opts)
            self.pipeline = pipe = Pipeline(recipe, exe, runtime, settings, Records(out), logdir, limits)
            running: dict[asyncio.Task, tuple[Group, Job]] = {}
            self.note = "running"
            try:
                while True:
                    # one group at a time, while fewer episodes than the pipeline's slots are here:
                    # a busy node leaves the queue to the others
                    if len(running) < slots:
                        for g in await queue.take.remote(self.name, 1):
                            for s in g.samples:
                                job = Job(g.task, s, g.attempt, ep.episode_id(g.task.id, s, g.attempt))
                                running[pipe.start(job)] = (g, job)
                    if not running:
                        status = await queue.status.remote()
                        if self.name in status["lost"]:  # declared lost while it had nothing to publish
                            self.fenced = f"node {self.name} was declared lost"
                            break
                        if status["finished"]:
                            break
                        await asyncio.sleep(POLL_S)
                        continue
                    done, _ = await asyncio.wait(list(running), timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        g, job = running.pop(t)
                        self.fenced = await self._publish(queue, store, logdir, g, job, where, len(pool.urls))
                        if self.fenced is not None:
                            break
                        if not any(rg.key == g.key for rg, _ in running.values()):
                            await queue.finish.remote(g.key, self.name, g.attempt)
                    if self.fenced is not None:  # declared lost: what it runs now runs elsewhere
                        break
            finally:
                for t in running:
                    t.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                await runtime.shutdown()
                self.urls = []
        self.note = "fenced" if self.fenced else "done"
        return {**where, **self.stats()}

    # -- this node's part in a fleet-wide weight sync (WeightsCoordinator) ------------------------
    # The proxies listen on this node's 127.0.0.1 only: the coordinator reaches them through Ray.
    def _not_running(self, what: str) -> dict:
        return {"proxy": self.name, "node": self.name, "status": None,
                "error": f"node {self.name} has no proxies running ({self.note}): cannot {what}"}

    async def weights_hold(self, version: str, lease_s: float, skip_first: bool) -> list[dict]:
        if not self.urls:
            return [self._not_running("hold")]
        answers = await hold_proxies(self.urls[1:] if skip_first else self.urls, version, lease_s=lease_s,
                                     headers=self._control)
        return [{**a, "node": self.name} for a in answers]

    async def weights_lead(self, path: str, version: str, peers_drained: bool | None) -> dict:
        if not self.urls:
            return self._not_running("lead the sync")
        return {**await lead_sync(self.urls[0], path, version, peers_drained, headers=self._control),
                "node": self.name}

    async def weights_release(self, held: list[dict], version: str, after: str | None, ok: bool,
                              keep: bool) -> list[dict]:
        return [{**a, "node": self.name} for a in await release_proxies(held, version, after, ok, keep=keep,
                                                                        headers=self._control)]

    async def weights_info(self) -> list[dict]:
        out = []
        for u in self.urls:
            status, body = await urllib_http("GET", u + SYNC_PATH, None, self._control, 30.0)
            out.append({"proxy": u, "node": self.name, "status": status, **json.loads(body)})
        return out

    async def _publish(self, queue, store: Store, logdir: Path, g: Group, job: Job, where: dict,
                       k: int) -> str | None:
        """Stage the episode's log (when it has one) in the store, then have the queue publish it
        with its record, naming this node (TaskQueue.publish). None when published, else why the
        queue refused (this node was declared lost)."""
        rec = {**job.record, **where, "proxies_on_node": k}
        log = logdir / f"{job.eid}.arrow"
        staged = None
        if log.exists():
            staged = f"{STAGING}/{self.name}/{job.eid}.arrow"
            await asyncio.to_thread(store.put_file, log, staged)
        why = await queue.publish.remote(g.key, job.sample, self.name, g.attempt, job.eid, rec, staged)
        if why is None:
            self.published += 1
        return why


WEIGHTS_ACTOR, NAMESPACE = "polar-fleet-weights", "polar"


class WeightsCoordinator:
    """The fleet's one weight-sync endpoint, a named Ray actor (``ray.get_actor(WEIGHTS_ACTOR,
    namespace=NAMESPACE)``): a sync holds every proxy of every node, the first node's first proxy
    has the server load (once), then every proxy is released (proxies.coordinate)."""

    def __init__(self, nodes: dict):
        self.nodes = nodes  # name -> RolloutNode handle

    def forget(self, name: str) -> None:
        self.nodes.pop(name, None)

    async def sync(self, path: str, version: str, lease_s: float = DEFAULT_LEASE_S) -> dict:
        import ray
        names = sorted(self.nodes)
        if not names:
            return asdict(SyncResult(503, None, error="the fleet has no live node"))
        lead_name = names[0]

        async def ask(name, ref, what):
            try:
                return await ref
            except ray.exceptions.RayError as exc:
                err = {"proxy": name, "node": name, "status": None, "error": f"{what} on {name}: {exc}"[:1000]}
                return [err] if what != "lead" else err

        async def hold():
            refs = [ask(n, self.nodes[n].weights_hold.remote(version, lease_s, n == lead_name), "hold") for n in names]
            return [a for answers in await asyncio.gather(*refs) for a in answers]

        async def lead(drained):
            return await ask(lead_name, self.nodes[lead_name].weights_lead.remote(path, version, drained), "lead")

        async def release(held, after, ok, keep):
            by_node: dict[str, list[dict]] = {}
            for h in held:
                by_node.setdefault(h["node"], []).append(h)
            refs = [ask(n, self.nodes[n].weights_release.remote(hs, version, after, ok, keep), "release")
                    for n, hs in by_node.items()]
            return [a for answers in await asyncio.gather(*refs) for a in answers]

        return asdict(await coordinate(version, hold, lead, release, lease_s))

    async def info(self) -> list[dict]:
        answers = await asyncio.gather(*(self.nodes[n].weights_info.remote() for n in sorted(self.nodes)))
        return [a for node in answers for a in node]


# -- the driver -----------------------------------------------------------------------------------
class Cluster:
    """Connect to Ray: ``address`` ("auto", "HOST:PORT") or ``local`` N nodes started here (a
    try-out and the tests: ray.cluster_utils.Cluster, as Ray's own tests run several nodes on one
    host). Stopped (local) or disconnected on exit."""

    def __init__(self, address: str | None = None, local: int | None = None, cpus_per_node: int = 1):
        if (address is None) == (local is None):
            raise ValueError("give exactly one of --ray-address and --local")
        if local is not None and local < 1:
            raise ValueError(f"--local needs at least one node, not {local}")
        self.address, self.local, self.cpus = address, local, cpus_per_node
        self.cluster = None
        self._auth = contextlib.ExitStack()
        self.token_path: Path | None = None

    def __enter__(self):
        import ray
        if self.local is not None:
            # token authentication (ray_auth.py): a new token per run, never in a sandbox
            self.token_path = self._auth.enter_context(token_auth())
            try:
                self._start_local()
            except BaseException:
                self._auth.close()
                raise
            ray.init(address=self.cluster.address, log_to_driver=False)
        else:
            join(self.address)  # RayJoinError in seconds when nothing answers there
        return self

    def _start_local(self) -> None:
        from ray.cluster_utils import Cluster as RayCluster
        # a try-out's nodes: small object stores (the fleet passes only small records) and no
        # dashboard, so N nodes fit on a laptop
        node = {"num_cpus": self.cpus, "object_store_memory": 128 * 2**20}
        self.cluster = RayCluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
        for _ in range(self.local - 1):
            self.cluster.add_node(**node)
        self.cluster.wait_for_nodes()

    def __exit__(self, *exc):
        import ray
        ray.shutdown()
        try:
            if self.cluster is not None:
                self.cluster.shutdown()
        finally:
            self._auth.close()


def alive_nodes() -> list[dict]:
    import ray
    return sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])


def node_name(node: dict) -> str:
    return "node-" + node["NodeID"][:12]


@dataclass
class FleetResult:
    nodes: dict[str, dict]  # each node's final stats (or its failure)
    lost: dict[str, str]  # nodes whose actor died or failed: why
    queue: dict
    seconds: float
    shards: dict = field(default_factory=dict)  # what Recon built

    @property
    def episodes(self) -> int:
        return sum(n.get("finished", 0) for n in self.nodes.values())


def run_fleet(cfg: NodeConfig, groups: list[Group], *, max_attempts: int = 3, on_stats=None,
              poll_s: float = 0.5) -> FleetResult:
    """Run every group on the connected Ray cluster's nodes; returns when the queue is finished
    and every node actor has returned (or died: its running groups are re-queued to the others)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    t0 = time.monotonic()
    store = Store(cfg.store)  # fail here, not on every node, for a bad URI
    recon = make_recon(store, cfg.samples)  # fleet/recon.py: in place on a shared filesystem, else mirrored
    recon.start()
    try:
        # the queue and the coordinator live on the driver's node: they must not die with a rollout node
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        queue = ray.remote(TaskQueue).options(num_cpus=0, name=QUEUE_ACTOR, namespace=NAMESPACE,
                                              scheduling_strategy=here).remote(groups, max_attempts, cfg.store)
        actors, refs = {}, {}
        for node in alive_nodes():
            name = node_name(node)
            strategy = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
            actors[name] = ray.remote(RolloutNode).options(num_cpus=0, max_restarts=0, scheduling_strategy=strategy,
                                                           max_concurrency=16).remote(name, cfg)
            refs[actors[name].run.remote(queue)] = name
        if not actors:
            raise RuntimeError("the Ray cluster has no alive node")
        weights = ray.remote(WeightsCoordinator).options(num_cpus=0, name=WEIGHTS_ACTOR, namespace=NAMESPACE,
                                                         max_concurrency=8, scheduling_strategy=here).remote(dict(actors))
        results: dict[str, dict] = {}
        lost: dict[str, str] = {}
        while refs:
            ready, _ = ray.wait(list(refs), timeout=poll_s)
            for ref in ready:
                name = refs.pop(ref)
                weights.forget.remote(name)  # its proxies are gone: later syncs skip it
                try:
                    results[name] = ray.get(ref)
                    if results[name].get("fenced"):  # declared lost while alive: it stopped itself
                        lost[name] = f"fenced: {results[name]['fenced']}"
                except ray.exceptions.RayError as exc:  # the actor died (its node, its process) or run() raised
                    lost[name] = f"{type(exc).__name__}: {exc}"[:2000]
                    published = [(r["task_id"], int(r["sample"])) for r in store.records() if r.get("node") == name]
                    back = ray.get(queue.node_lost.remote(name, published))
                    results[name] = {"node": name, "error": lost[name], "requeued": back}
                    ray.kill(actors[name])  # (if its process still runs somewhere; the queue fences it anyway)
            if on_stats is not None:
                live = [actors[n] for n in refs.values()]
                try:
                    stats = ray.get([a.stats.remote() for a in live], timeout=5)
                except ray.exceptions.RayError:
                    stats = []
                on_stats(stats + [results[n] for n in results], ray.get(queue.status.remote()), time.monotonic() - t0)
    except BaseException:
        recon.abort()
        raise
    status = ray.get(queue.status.remote())
    ray.kill(weights)
    # every node actor has returned or been killed: what is still staged (a log a node staged and
    # never got to publish, as it died or was fenced) is garbage
    store.fs.delete_dir_contents(store.path(STAGING), missing_dir_ok=True)
    shards = recon.finish()
    res = FleetResult(results, lost, status, time.monotonic() - t0, shards)
    store.put_json("rollout/fleet.json", {"nodes": results, "lost": lost, "queue": status, "seconds": res.seconds,
                                          "episodes": res.episodes, "shards": shards,
                                          "config": asdict(cfg) | {"api_key": None}})
    return res
