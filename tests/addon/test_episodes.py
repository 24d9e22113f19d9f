"""Episodes (sans-IO apart from the files): in-flight calls and the deferred end record."""
from __future__ import annotations

import numpy as np
import pytest

from addon.open_logs import EpisodeEnding, EpisodeFinished, Episodes
from polar_contracts.log.reader import read_episode


def _row(w, i):
    w.append_call(call_index=i, prompt_ids=np.array([1, 2], dtype=np.int32),
                  completion_ids=np.array([3], dtype=np.int32), completion_logprobs=np.array([-0.5], dtype=np.float32))


def test_end_without_inflight_is_immediate(tmp_path):
    eps = Episodes(tmp_path)
    w, i = eps.begin_call("a")
    _row(w, i)
    assert eps.call_done("a") is None
    assert eps.end("a", 1.0, {"x": 1}) == 1
    assert read_episode(tmp_path / "a.arrow").finished
    with pytest.raises(EpisodeFinished):
        eps.begin_call("a")


def test_end_waits_for_the_last_inflight_call(tmp_path):
    eps = Episodes(tmp_path)
    w, i0 = eps.begin_call("b")
    _, i1 = eps.begin_call("b")
    ended = []
    assert eps.end("b", 0.5, {}, on_end=ended.append) is None  # deferred: two calls in flight
    assert eps.inflight("b") == 2
    with pytest.raises(EpisodeEnding, match="ending"):
        eps.begin_call("b")
    with pytest.raises(EpisodeEnding):
        eps.end("b", 0.1, {})
    _row(w, i1)
    assert eps.call_done("b") is None and ended == []
    assert not read_episode(tmp_path / "b.arrow").finished
    _row(w, i0)  # the last one: its row, then the end record
    assert eps.call_done("b") == 2 and ended == [2]
    log = read_episode(tmp_path / "b.arrow")
    assert log.finished and log.reward == 0.5 and log.calls["call_index"].to_list() == [0, 1]


def test_shutdown_writes_pending_ends(tmp_path):
    eps = Episodes(tmp_path)
    eps.begin_call("c")
    eps.begin_call("d")
    ended = []
    assert eps.end("c", 2.0, {}, on_end=ended.append) is None
    eps.close_all()
    assert ended == [0]
    assert read_episode(tmp_path / "c.arrow").finished
    assert not read_episode(tmp_path / "d.arrow").finished  # not ended: a later proxy may continue it


def test_deferred_end_that_cannot_be_written_is_told_and_can_be_sent_again(tmp_path, monkeypatch):
    """A full disk refuses the end record written after the last in-flight call: whoever waits on
    the end gets the error (the proxy answers 503, retry), never a success, and the end can be
    sent again once the disk takes it."""
    import errno

    from polar_contracts.log.writer import EpisodeWriter

    eps = Episodes(tmp_path)
    eps.begin_call("e")
    got = []
    assert eps.end("e", 1.0, {}, on_end=got.append) is None
    real_end = EpisodeWriter.end

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(EpisodeWriter, "end", full)
    with pytest.raises(OSError):
        eps.call_done("e")
    assert len(got) == 1 and isinstance(got[0], OSError)
    assert not read_episode(tmp_path / "e.arrow").finished
    monkeypatch.setattr(EpisodeWriter, "end", real_end)
    assert eps.end("e", 1.0, {}) == 0  # sent again: written
    assert read_episode(tmp_path / "e.arrow").finished
