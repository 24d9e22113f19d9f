"""The weight-sync gate (addon/weight_gate.py), sans-IO: property tests over random interleavings of
calls starting and finishing with syncs holding, loading and releasing; plus the strict parsing of
the sync request body and of the servers' answers (addon/weight_hold.py, addon/server_weights.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from addon.server_weights import Step, check_step, parse_version_answer, sync_steps
from addon.weight_gate import DRAINING, LOADING, SERVING, GateBusy, WeightGate
from polar_contracts.control import ControlRequestError, parse_sync_body
from polar_contracts.weight_versions import is_marker, spanning, spans_of

OPS = st.lists(st.sampled_from(["call", "finish", "hold", "load", "release_ok", "release_fail"]), max_size=60)


@settings(max_examples=400, deadline=None)
@given(OPS, st.randoms(use_true_random=False))
def test_gate_interleavings(ops, rnd):
    """Whatever the order: calls are admitted only while serving; a finished call keeps the version
    it started under unless it was in flight when loading began (then it spans exactly old -> target);
    the version advances only on a successful release; waiting calls are admitted after any release."""
    g = WeightGate("v0")
    live, finished, versions = [], [], ["v0"]
    n = 0
    for op in ops:
        if op == "call":
            t = g.admit()
            assert (t is None) == (g.state != SERVING)
            if t is not None:
                assert t.start_version == g.version
                live.append(t)
        elif op == "finish" and live:
            t = live.pop(rnd.randrange(len(live)))
            g.finish(t)
            g.finish(t)  # idempotent
            finished.append(t)
        elif op == "hold":
            if g.state == SERVING:
                n += 1
                g.hold(f"v{n}")
                assert g.state == DRAINING and g.target == f"v{n}"
            else:
                with pytest.raises(GateBusy):
                    g.hold("other")
        elif op == "load" and g.state == DRAINING:
            old, inflight = g.version, set(g.inflight)
            spanned = g.load()
            assert set(spanned) == inflight and g.state == LOADING
            for t in spanned:
                assert t.version == spanning(t.start_version, g.target) and is_marker(t.version)
                assert spans_of(t.version) == [t.start_version, g.target] and t.start_version in (old, *versions)
        elif op.startswith("release") and g.state != SERVING:
            before, target = g.version, g.target
            ok = op == "release_ok"
            g.release(target if ok else before, ok)
            assert g.state == SERVING and g.version == (target if ok else before)
            versions.append(g.version)
            t = g.admit()  # a held call goes through now, under the version the sync ended with
            assert t is not None and t.start_version == g.version
            live.append(t)
        assert g.inflight == set(live) and g.drained == (not live)
    # a finished call's version never changes afterwards, whatever sync comes next
    seen = [(t, t.version) for t in finished]
    if g.state == SERVING:
        g.hold("last")
    if g.state == DRAINING:
        g.load()
    assert all(t.version == v for t, v in seen)
    assert all(t.spanned for t in live)  # those still in flight span the last load


def test_release_without_sync_and_load_outside_draining():
    g = WeightGate("a")
    with pytest.raises(RuntimeError, match="no sync running"):
        g.release("b", True)
    with pytest.raises(RuntimeError, match="expected draining"):
        g.load()


@pytest.mark.parametrize("body, message", [
    (b"", "not valid JSON"),
    (b"[1]", "must be a JSON object"),
    (b'{"path": "/m"}', "missing keys \\['version'\\]"),
    (b'{"path": "/m", "version": "1", "model": "x"}', "unknown keys \\['model'\\]"),
    (b'{"path": "", "version": "1"}', "non-empty directory path"),
    (b'{"path": "/m", "version": 3}', "'version' must be a string"),
    (b'{"path": "/m", "version": "a b"}', "must be a string matching"),
    (b'{"path": "/m", "version": "spans:x"}', "not start with"),
    (b'{"path": "/m", "version": "unknown:x"}', "not start with"),
])
def test_sync_body_is_validated_strictly(body, message):
    with pytest.raises(ControlRequestError, match=message):
        parse_sync_body(body)


def test_sync_body_ok():
    assert parse_sync_body(b'{"path": "/w/step-000002", "version": "step-000002"}') == ("/w/step-000002",
                                                                                       "step-000002")


def test_server_steps_and_answers():
    v = sync_steps("vllm", "/w", "s1", drained=True)
    assert [(s.what, s.path) for s in v] == [
        ("pause", "/pause?mode=wait"), ("reload_weights", "/collective_rpc"),
        ("update_weight_version", "/update_weight_version"), ("resume", "/resume")]
    assert v[1].body == {"method": "reload_weights", "kwargs": {"weights_path": "/w"}} and v[1].loads
    assert v[-1].always and v[2].body == {"new_version": "s1"}
    keep = sync_steps("vllm", "/w", "s1", drained=False)
    assert keep[0].path == "/pause?mode=keep" and keep[2].what == "reset_prefix_cache"
    (s,) = sync_steps("sglang", "/w", "s1", drained=True)
    assert s.body == {"model_path": "/w", "weight_version": "s1"}
    assert check_step("sglang", s, 200, b'{"success": true, "message": "ok"}') is None
    assert "did not succeed" in check_step("sglang", s, 200, b'{"success": false}')
    assert "HTTP 400" in check_step("sglang", s, 400, b'{"success": false, "message": "Failed"}')
    p = Step("reload", "POST", "/polar/reload", loads=True)
    assert "without weight_version" in check_step("polar-serve", p, 200, b"{}")
    assert parse_version_answer("vllm", 200, b'{"weight_version": "default"}') == "default"
    with pytest.raises(ValueError, match="HTTP 404"):
        parse_version_answer("vllm", 404, b'{"detail": "Not Found"}')
    with pytest.raises(ValueError, match="no weight_version"):
        parse_version_answer("sglang", 200, b'{"model_path": "/m"}')
