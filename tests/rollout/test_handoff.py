"""The scheduler's hand-off to reconstruction reads only the log's end record (read_head), never
the whole episode: it polls a log the proxy may still be writing."""
from __future__ import annotations

import asyncio
import threading

import pytest

import harness_recipes.node.scheduler as scheduler
import polar_contracts.log.arrays as arrays
import polar_contracts.log.reader as reader
from harness_recipes.node.scheduler import Job, Limits, Pipeline
from polar_contracts.log.writer import EpisodeWriter


def _pipeline(logdir, log_wait=5.0) -> Pipeline:
    # _handoff uses only the log directory and the wait: the rest of the pipeline stays unset
    return Pipeline(None, None, None, None, None, logdir=logdir, limits=Limits(), log_wait=log_wait)


def _job(eid: str) -> Job:
    return Job(task=None, sample=0, attempt=0, eid=eid)


@pytest.fixture
def heads_only(monkeypatch):
    """Every full reader fails the test if called; read_head calls are counted."""
    def forbidden(*a, **k):
        raise AssertionError("_handoff decoded the whole log")

    for mod, name in ((reader, "read_episode"), (reader, "read_log"), (arrays, "read_calls"), (arrays, "decode_log")):
        monkeypatch.setattr(mod, name, forbidden)
    calls = []
    real = scheduler.read_head

    def counting(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(scheduler, "read_head", counting)
    return calls


def _write(path, n: int, *, end: bool) -> EpisodeWriter:
    w = EpisodeWriter(path, path.stem)
    prompt = [1, 2, 3]
    for _ in range(n):
        w.append_call(call_index=w.next_call_index(), prompt_ids=prompt, completion_ids=[4], completion_logprobs=[-1.0])
        prompt = prompt + [4, 5]
    if end:
        w.end(1.0, {})
    return w


def test_a_finished_log_is_handed_off_from_its_head(tmp_path, heads_only):
    _write(tmp_path / "e1.arrow", 3, end=True)
    job = _job("e1")
    asyncio.run(_pipeline(tmp_path)._handoff(job))
    assert job.record == {"n_calls": 3, "log_finished": True}
    assert len(heads_only) == 1


def test_the_hand_off_waits_for_the_end_record(tmp_path, heads_only):
    w = _write(tmp_path / "e2.arrow", 2, end=False)
    timer = threading.Timer(0.35, lambda: w.end(0.0, {}))
    timer.start()
    try:
        job = _job("e2")
        asyncio.run(_pipeline(tmp_path)._handoff(job))
    finally:
        timer.cancel()
    assert job.record == {"n_calls": 2, "log_finished": True}
    assert len(heads_only) >= 2  # polled (at 0.1 s) until the end record landed


def test_an_unfinished_log_is_handed_off_unfinished_after_the_wait(tmp_path, heads_only):
    _write(tmp_path / "e3.arrow", 1, end=False)
    job = _job("e3")
    asyncio.run(_pipeline(tmp_path, log_wait=0.2)._handoff(job))
    assert job.record == {"n_calls": 1, "log_finished": False}


def test_no_log_is_noted(tmp_path, heads_only):
    job = _job("missing")
    asyncio.run(_pipeline(tmp_path, log_wait=0.2)._handoff(job))
    assert job.record["log_finished"] is False and job.record["n_calls"] == 0
    assert "no capture log at" in job.record["log_note"] and "missing.arrow" in job.record["log_note"]


def test_the_scheduler_imports_no_full_reader():
    """Structural: the module has the head reader and none of the decoding ones."""
    assert scheduler.read_head.__module__ == "polar_contracts.log.end_record"
    for name in ("read_episode", "read_log", "read_calls", "decode_log"):
        assert not hasattr(scheduler, name), name
