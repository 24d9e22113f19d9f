"""Episodes (sans-IO apart from the files): in-flight calls and the deferred end record."""
from __future__ import annotations

import numpy as np
import pytest

from addon.open_logs import EpisodeEnding, EpisodeFinished, Episodes
from polar_recon import read_episode


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
