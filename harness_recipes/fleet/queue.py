"""The fleet's one task queue, sans-IO (no Ray, no clock): the Ray actor in driver.py wraps it.

The unit of work is one GRPO group: a task with the samples of it still to run. A node takes a
whole group, so the group's episodes are reconstructed together on that node (its shards hold
complete groups) and a group is never split between two nodes' shards.

Nodes pull (``take``) when they have free slots, so a fast node takes more groups than a slow one
(work stealing, not a static split). ``node_lost`` fences the node (it takes nothing more and
``may_publish`` refuses its episodes from then on: a node declared lost may still be alive, a
zombie behind a partition or a raylet that died under a live worker, and it must not publish an
attempt that now runs elsewhere) and puts the groups a dead node was running back
at the front of the queue with the next attempt number, so each retry is a new episode id that
names the task, the sample and the attempt (``episode.episode_id``); after ``max_attempts`` a
group is given up and reported, never retried forever.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from harness_recipes.node.episode import TERMINAL, episode_id
from harness_recipes.tasks.task_file import Task

QUEUED, RUNNING, DONE, GIVEN_UP = "queued", "running", "done", "given up"


@dataclass
class Group:
    task: Task
    samples: tuple[int, ...]  # the samples of this task still to run
    attempt: int = 0  # the group's attempt: every episode of it gets this attempt number
    node: str | None = None
    state: str = QUEUED
    lost_on: list[str] = field(default_factory=list)  # the nodes it ran on that died
    done_samples: set[int] = field(default_factory=set)  # recorded by a node: never run again

    @property
    def key(self) -> str:
        return self.task.id

    def episode_ids(self) -> list[str]:
        return [episode_id(self.task.id, s, self.attempt) for s in self.samples]


class WorkQueue:
    def __init__(self, groups: list[Group], max_attempts: int = 3):
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {max_attempts}")
        keys = [g.key for g in groups]
        if len(set(keys)) != len(keys):
            raise ValueError("a task id appears twice in the fleet's queue")
        self.groups = {g.key: g for g in groups}
        self.queue: deque[str] = deque(keys)
        self.max_attempts = max_attempts
        self.taken: dict[str, int] = {}  # groups each node took
        self.lost: set[str] = set()  # nodes declared lost: fenced for good

    def take(self, node: str, n: int = 1) -> list[Group]:
        """Up to ``n`` queued groups for ``node`` (none for a node declared lost)."""
        out = []
        if node in self.lost:
            return out
        while self.queue and len(out) < n:
            g = self.groups[self.queue.popleft()]
            g.state, g.node = RUNNING, node
            self.taken[node] = self.taken.get(node, 0) + 1
            out.append(g)
        return out

    def may_publish(self, key: str, sample: int, node: str, attempt: int) -> str | None:
        """None when ``node``'s episode (``key``, ``sample``, ``attempt``) is the current one and not yet
        published, so it may be; else why not (the node was declared lost, the attempt is stale, the
        sample is done). The fleet's queue actor checks this and publishes in one call (serially
        with ``node_lost``), so no check-then-publish race lets a fenced node through."""
        if node in self.lost:
            return f"node {node} was declared lost: its unpublished episodes were re-queued"
        g = self.groups.get(key)
        if g is None:
            return f"no group {key!r} in the queue"
        if g.state != RUNNING or g.node != node or g.attempt != attempt:
            return (f"attempt {attempt} of {key!r} on {node} is stale: the group is {g.state} "
                    f"(attempt {g.attempt}, node {g.node})")
        if sample not in g.samples or sample in g.done_samples:
            return f"sample {sample} of {key!r} is not one to publish (already published or not in the group)"
        return None

    def episode_done(self, key: str, sample: int, node: str, attempt: int) -> bool:
        """``node`` recorded one episode of the group (its log and record are in the store): a
        retry of the group after the node dies leaves that sample out. False when stale."""
        g = self.groups.get(key)
        if g is None or g.state != RUNNING or g.node != node or g.attempt != attempt or sample not in g.samples:
            return False
        g.done_samples.add(sample)
        return True

    def finish(self, key: str, node: str, attempt: int) -> bool:
        """``node`` finished its attempt of the group; False (ignored) when that attempt is stale:
        the group was re-queued after its node was declared lost and runs under a later attempt."""
        g = self.groups.get(key)
        if g is None or g.state != RUNNING or g.node != node or g.attempt != attempt:
            return False
        g.state = DONE
        return True

    def node_lost(self, node: str, published: set[tuple[str, int]] = frozenset()) -> list[Group]:
        """Re-queue (first in line) the groups ``node`` was running; returns them. A group past
        max_attempts is given up instead. ``published``: the (task, sample) pairs whose records
        the node put in the store (the store is the truth: the node may have died between putting
        a record and telling the queue); those samples are done, never run twice."""
        self.lost.add(node)
        back = []
        for g in self.groups.values():
            if g.state != RUNNING or g.node != node:
                continue
            g.done_samples |= {s for (k, s) in published if k == g.key and s in g.samples}
            g.lost_on.append(node)
            g.node = None
            g.samples = tuple(x for x in g.samples if x not in g.done_samples)
            if not g.samples:  # every episode was recorded before the node died
                g.state = DONE
            elif g.attempt + 1 >= self.max_attempts:
                g.state = GIVEN_UP
            else:
                g.attempt += 1
                g.state = QUEUED
                back.append(g)
        self.queue.extendleft(reversed([g.key for g in back]))
        return back

    @property
    def finished(self) -> bool:
        """Nothing queued and nothing running: every group is done or given up."""
        return all(g.state in (DONE, GIVEN_UP) for g in self.groups.values())

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in (QUEUED, RUNNING, DONE, GIVEN_UP)}
        for g in self.groups.values():
            out[g.state] += 1
        return out


def plan_groups(tasks: list[Task], samples: int, records: list[dict] = ()) -> tuple[list[Group], int]:
    """The groups still to run and how many episodes are skipped: a (task, sample) whose last
    record (highest attempt) has a terminal status is done (a resumed fleet skips it); the others
    of a task run again as one group under the next attempt number, so every retry is a new
    episode id and never appends to an old log."""

    last: dict[tuple[str, int], dict] = {}
    for r in records:
        try:
            key, attempt = (r["task_id"], int(r["sample"])), int(r.get("attempt", 0))
        except (KeyError, TypeError, ValueError):
            continue  # not a rollout record
        if key not in last or attempt >= int(last[key].get("attempt", 0)):
            last[key] = r
    out, skipped = [], 0
    for t in tasks:
        todo = tuple(s for s in range(samples) if last.get((t.id, s), {}).get("status") not in TERMINAL)
        skipped += samples - len(todo)
        if todo:
            attempt = max((int(last[(t.id, s)].get("attempt", 0)) + 1 for s in range(samples) if (t.id, s) in last),
                          default=0)
            out.append(Group(t, todo, attempt))
    return out, skipped
