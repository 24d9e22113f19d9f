"""The fleet's task queue (fleet_queue.WorkQueue, sans-IO) and its shared store (store.Store on a
file:// URI, as on a shared filesystem)."""
from __future__ import annotations

import pickle

import pytest

from harness_recipes.fleet.queue import DONE, GIVEN_UP, QUEUED, RUNNING, Group, WorkQueue
from harness_recipes.fleet.store import Store, StoreError
from harness_recipes.tasks.task_file import Task


def groups(n, samples=2):
    return [Group(Task(f"t{i}", "p", "true"), tuple(range(samples))) for i in range(n)]


def test_nodes_pull_whole_groups_so_a_fast_node_takes_more():
    q = WorkQueue(groups(5))
    a = q.take("fast", 1)
    b = q.take("slow", 1)
    assert [g.key for g in a + b] == ["t0", "t1"] and a[0].episode_ids() == ["t0.s0", "t0.s1"]
    assert q.finish("t0", "fast", 0)
    assert [g.key for g in q.take("fast", 2)] == ["t2", "t3"]
    assert q.taken == {"fast": 3, "slow": 1} and not q.finished
    assert q.counts() == {QUEUED: 1, RUNNING: 3, DONE: 1, GIVEN_UP: 0}


def test_a_lost_node_s_groups_go_first_with_a_new_attempt_and_only_unrecorded_samples():
    q = WorkQueue(groups(3, samples=3), max_attempts=2)
    g0, = q.take("n1", 1)
    assert q.episode_done("t0", 1, "n1", 0)
    back = q.node_lost("n1")
    assert [g.key for g in back] == ["t0"] and g0.samples == (0, 2) and g0.attempt == 1 and g0.lost_on == ["n1"]
    assert g0.episode_ids() == ["t0.s0.a1", "t0.s2.a1"]  # new episode ids: the task, sample and attempt
    g, = q.take("n2", 1)
    assert g is g0  # first in line
    assert not q.finish("t0", "n1", 0)  # the dead node's late word is ignored
    assert not q.episode_done("t0", 0, "n1", 0)
    q.node_lost("n2")  # a second loss: max_attempts=2 reached
    assert g0.state == GIVEN_UP


def test_a_group_recorded_in_full_before_its_node_died_is_done():
    q = WorkQueue(groups(1, samples=1))
    q.take("n1", 1)
    q.episode_done("t0", 0, "n1", 0)
    assert q.node_lost("n1") == [] and q.finished and q.counts()[DONE] == 1


def test_queue_input_is_checked():
    with pytest.raises(ValueError, match="appears twice"):
        WorkQueue(groups(1) + groups(1))
    with pytest.raises(ValueError, match="max_attempts"):
        WorkQueue(groups(1), max_attempts=0)


def test_store_writes_whole_objects_and_lists_them(tmp_path):
    s = Store(f"file://{tmp_path}/run")
    s.put_json("rollout/records/e1.json", {"episode_id": "e1", "node": "n"})
    (tmp_path / "x.arrow").write_bytes(b"log")
    s.put_file(tmp_path / "x.arrow", "logs/e1.arrow")
    assert s.list("logs") == ["e1.arrow"] and s.get_bytes("logs/e1.arrow") == b"log"
    assert s.records() == [{"episode_id": "e1", "node": "n"}]
    assert not [p for p in (tmp_path / "run").rglob("*") if p.name.endswith(".tmp")]
    assert s.list("shards") == []
    assert pickle.loads(pickle.dumps(s)).root == s.root  # sent to Ray actors


def test_a_bad_store_uri_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError, match="not a filesystem URI"):
        Store("nosuchscheme://x/y")
    (tmp_path / "file").write_text("")
    with pytest.raises(StoreError, match="cannot create"):
        Store(f"file://{tmp_path}/file/sub")


def test_a_resumed_fleet_skips_done_episodes_and_retries_the_rest_under_a_new_attempt():
    from harness_recipes.fleet.queue import plan_groups
    tasks = [Task("t0", "p", "true"), Task("t1", "p", "true"), Task("t2", "p", "true")]
    recs = [{"task_id": "t0", "sample": 0, "attempt": 0, "status": "done"},
            {"task_id": "t0", "sample": 1, "attempt": 0, "status": "error"},
            {"task_id": "t1", "sample": 0, "attempt": 0, "status": "interrupted"},
            {"task_id": "t1", "sample": 0, "attempt": 1, "status": "timeout"},
            {"task_id": "t1", "sample": 1, "attempt": 0, "status": "crashed"},
            {"node": "not a record"}]
    groups, skipped = plan_groups(tasks, 2, recs)
    assert skipped == 3
    assert [(g.key, g.samples, g.attempt) for g in groups] == [("t0", (1,), 1), ("t2", (0, 1), 0)]
    assert groups[0].episode_ids() == ["t0.s1.a1"]
    fresh, none = plan_groups(tasks, 2)
    assert none == 0 and [g.samples for g in fresh] == [(0, 1)] * 3


def test_samples_a_lost_node_published_but_never_acknowledged_are_not_run_again():
    q = WorkQueue(groups(1, samples=3))
    g, = q.take("n1", 1)
    q.episode_done("t0", 0, "n1", 0)
    # sample 1's record reached the store, then the node died before telling the queue
    back = q.node_lost("n1", {("t0", 1), ("other", 2)})
    assert [b.samples for b in back] == [(2,)] and g.attempt == 1


def test_a_node_declared_lost_is_fenced_even_if_it_is_still_alive():
    """A zombie (declared lost, still running) may not publish the attempt that now runs elsewhere,
    nor take more work; the new attempt's node may publish, once per sample."""
    q = WorkQueue([Group(Task("t0", "p", "true"), (0, 1)), Group(Task("t1", "p", "true"), (0,))])
    [g0] = q.take("n1", 1)
    assert q.may_publish("t0", 0, "n1", 0) is None and q.episode_done("t0", 0, "n1", 0)
    assert "already published" in q.may_publish("t0", 0, "n1", 0)
    [back] = q.node_lost("n1")
    assert back.key == "t0" and back.attempt == 1 and back.samples == (1,)
    assert "n1 was declared lost" in q.may_publish("t0", 1, "n1", 0)  # the zombie's late episode
    assert q.take("n1", 5) == []  # and it gets no more work
    [g] = q.take("n2", 1)
    assert g.key == "t0"
    assert "is stale" in q.may_publish("t0", 1, "n2", 0)  # an old attempt number is refused too
    assert q.may_publish("t0", 1, "n2", 1) is None and q.episode_done("t0", 1, "n2", 1)
    assert "already published" in q.may_publish("t0", 1, "n2", 1)
    assert "no group 'x'" in q.may_publish("x", 0, "n2", 0)
