"""The control protocol's secret and capabilities, the proxy's routing rules, and the bounds on
control bodies (sans-IO: polar_contracts/control.py, addon/routing.py)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from addon.routing import END_KIND, MODEL, MODELS, WEIGHTS, RouteError, claimed_episode, route
from polar_contracts.control import (
    CAP_SEP,
    CONTROL_HEADER,
    MAX_JSON_DEPTH,
    ControlRequestError,
    capability,
    capability_mac,
    check_capability,
    check_secret,
    json_depth,
    new_secret,
    parse_end_body,
    parse_hold_body,
    read_secret_file,
    write_secret_file,
)

SECRET = new_secret()
OTHER = new_secret()


# -- capabilities ---------------------------------------------------------------------------------
def test_capability_round_trip_and_shape():
    cap = capability(SECRET, "task-1.s0")
    eid, sep, mac = cap.rpartition(CAP_SEP)
    assert (eid, sep) == ("task-1.s0", CAP_SEP) and capability_mac(cap) == mac
    assert len(mac) >= 22 and set(mac) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
    assert check_capability(SECRET, cap) == "task-1.s0"
    assert capability(SECRET, "task-1.s0") == cap and capability(OTHER, "task-1.s0") != cap
    assert capability(SECRET, "task-1.s1") != cap


@pytest.mark.parametrize("bad, why", [
    ("task-1.s0", "bare episode id"),
    ("task-1.s0~", "not base64url"),
    ("task-1.s0~AAAAAAAAAAAAAAAAAAAAAA", "wrong mac"),
    ("../x~AAAA", "must match"),
    ("task-1.s0~ab/cd", "not base64url"),
])
def test_check_capability_refuses_with_403_naming_the_problem(bad, why):
    with pytest.raises(ControlRequestError, match=why) as ei:
        check_capability(SECRET, bad)
    assert ei.value.status == 403


def test_a_capability_does_not_transfer_to_a_sibling_or_another_secret():
    mine = capability(SECRET, "task.s0")
    sibling = "task.s1" + CAP_SEP + capability_mac(mine)  # my mac on my sibling's id
    with pytest.raises(ControlRequestError, match="wrong mac"):
        check_capability(SECRET, sibling)
    with pytest.raises(ControlRequestError, match="wrong mac"):
        check_capability(OTHER, mine)


def test_check_secret():
    check_secret(SECRET, SECRET)
    for given, why in ((None, "without header"), ("", "without header"), (SECRET[:-1] + "x", "wrong"),
                       ("é" * 50, "wrong")):
        with pytest.raises(ControlRequestError, match=why) as ei:
            check_secret(SECRET, given)
        assert ei.value.status == 403 and SECRET not in str(ei.value)


def test_secret_file_0600_exclusive_and_strict(tmp_path):
    p = tmp_path / "secret"
    write_secret_file(p, SECRET)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600 and read_secret_file(p) == SECRET
    with pytest.raises(FileExistsError):
        write_secret_file(p, OTHER)  # never overwritten
    p.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_secret_file(p)
    link = tmp_path / "link"
    link.symlink_to(p)
    with pytest.raises(ValueError, match="symlink"):
        read_secret_file(link)
    target = tmp_path / "planted-target"
    (tmp_path / "planted").symlink_to(target)
    with pytest.raises(FileExistsError):
        write_secret_file(tmp_path / "planted", SECRET)  # a planted link is not followed
    assert not target.exists()
    short = tmp_path / "short"
    fd = os.open(short, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"abc")
    os.close(fd)
    with pytest.raises(ValueError, match="16 to 4096"):
        read_secret_file(short)


# -- routing with a secret ---------------------------------------------------------------------
CHAT = "/v1/chat/completions"


def test_model_call_by_capability_in_header_or_prefix():
    cap = capability(SECRET, "e1")
    r = route("POST", CHAT, {"x-polar-episode": cap}, "default", SECRET)
    assert (r.kind, r.episode_id, r.path, r.mac) == (MODEL, "e1", CHAT, capability_mac(cap))
    r = route("POST", f"/polar/{cap}/v1/messages?beta=true", {}, "default", SECRET)
    assert (r.kind, r.episode_id, r.path) == (MODEL, "e1", "/v1/messages?beta=true")
    r = route("GET", f"/polar/{cap}/v1/models", {}, "default", SECRET)
    assert (r.kind, r.episode_id) == (MODELS, "e1")
    r = route("POST", "/polar/" + cap.replace("~", "%7E") + CHAT, {}, "default", SECRET)  # an encoded "~"
    assert (r.kind, r.episode_id) == (MODEL, "e1")


@pytest.mark.parametrize("headers, path", [
    ({"x-polar-episode": "e1"}, CHAT),  # a bare id
    ({}, "/polar/e1/v1/chat/completions"),
    ({"x-polar-episode": "e1~" + capability_mac(capability(OTHER, "e1"))}, CHAT),  # another secret's mac
    ({}, CHAT),  # no episode at all: not the default episode
    ({"x-polar-episode": capability(SECRET, "e1")}, "/polar/e2/v1/chat/completions"),  # a bare id beside it
])
def test_model_call_without_a_valid_capability_is_403(headers, path):
    with pytest.raises(RouteError) as ei:
        route("POST", path, headers, "default", SECRET)
    assert ei.value.status == 403


def test_control_requests_need_the_secret():
    for method, path in (("POST", "/polar/e1/end"), ("POST", "/polar/@weights"), ("GET", "/polar/@weights"),
                         ("POST", "/polar/@weights/hold"), ("POST", "/polar/@weights/release"),
                         ("POST", f"/polar/{capability(SECRET, 'e1')}/end")):
        for headers in ({}, {CONTROL_HEADER: OTHER}, {CONTROL_HEADER: capability(SECRET, "e1")}):
            with pytest.raises(RouteError) as ei:
                route(method, path, headers, "default", SECRET)
            assert ei.value.status == 403, (method, path, headers)
    ok = {CONTROL_HEADER: SECRET}
    assert route("POST", "/polar/e1/end", ok, "d", SECRET).kind == END_KIND
    r = route("POST", "/polar/@weights/hold", ok, "d", SECRET)
    assert (r.kind, r.endpoint) == (WEIGHTS, "/polar/@weights/hold")
    with pytest.raises(RouteError) as ei:
        route("POST", "/polar/@nothing", ok, "d", SECRET)
    assert ei.value.status == 404


@pytest.mark.parametrize("secret", [SECRET, None])
@pytest.mark.parametrize("method, path", [
    ("POST", "/polar/reload"), ("GET", "/polar/weight_version"), ("POST", "/collective_rpc"), ("POST", "/pause"),
    ("POST", "/sleep"), ("POST", "/wake_up"), ("POST", "/update_weights_from_disk"), ("POST", "/tokenize"),
    ("GET", "/metrics"), ("POST", "/v1/load_lora_adapter"), ("GET", "/"), ("HEAD", "/"),
    ("POST", "/v1/chat/completions/../../polar/reload"), ("POST", "/v1/chat%2Fcompletions"),
    ("GET", "/v1/chat/completions"), ("POST", "/v1/models"), ("GET", "/v1/models/../../pause"),
    ("POST", "/chat/completions"), ("GET", "/v1/messages/count_tokens"), ("POST", "/v1/messages/count_tokens/x"),
])
def test_only_model_api_routes_pass(secret, method, path):
    """Whatever the episode naming, a path that is not the model API is refused (403), also behind
    a valid capability prefix: the prefix is never stripped to forward a non-model path."""
    cap = capability(SECRET, "e1")
    for p, headers in ((path, {"x-polar-episode": cap}), (f"/polar/{cap}{path}", {})):
        with pytest.raises(RouteError, match="not a model API route") as ei:
            route(method, p, headers, "default", secret)
        assert ei.value.status == 403


@pytest.mark.parametrize("path", ["/v1/messages/count_tokens", "/messages/count_tokens", "/v1/messages/count_tokens?beta=1"])
def test_count_tokens_passes_uncaptured_with_its_capability(path):
    """Claude Code's token count: forwarded (kind MODELS: not a captured call), like every model
    route only for a valid capability."""
    cap = capability(SECRET, "e1")
    r = route("POST", f"/polar/{cap}{path}", {}, "d", SECRET)
    assert (r.kind, r.episode_id, r.path) == (MODELS, "e1", path)
    with pytest.raises(RouteError) as ei:
        route("POST", path, {"x-polar-episode": "e1"}, "d", SECRET)
    assert ei.value.status == 403


def test_open_proxy_keeps_bare_ids_and_the_default_episode():
    assert route("POST", CHAT, {}, "dflt").episode_id == "dflt"
    assert route("POST", "/polar/e1/v1/completions", {}, "d").episode_id == "e1"
    assert route("POST", CHAT, {"x-polar-episode": capability(SECRET, "e1")}, "d").episode_id == "e1"
    assert route("POST", "/polar/e1/end", {}, "d").is_end


def test_claimed_episode_never_reports_the_mac():
    cap = capability(SECRET, "e1")
    assert claimed_episode(f"/polar/{cap}/polar/reload", {}) == "e1"
    assert claimed_episode("/x", {"x-polar-episode": cap}) == "e1"
    assert claimed_episode("/polar/../x", {}) is None


# -- bounded control bodies ----------------------------------------------------------------------
@pytest.mark.parametrize("reward", [1e308, -1e7, 1e6 + 1])
def test_reward_bounded(reward):
    with pytest.raises(ControlRequestError, match="out of bounds") as ei:
        parse_end_body(json.dumps({"reward": reward}).encode())
    assert ei.value.status == 400


def test_deep_json_is_refused_without_recursing():
    for body in (b"[" * 200_000 + b"]" * 200_000, b'{"metadata":' * 50_000 + b"1" + b"}" * 50_000):
        with pytest.raises(ControlRequestError) as ei:
            parse_end_body(body, max_bytes=1 << 20)
        assert ei.value.status == 400 and "nested" in str(ei.value)
    with pytest.raises(ControlRequestError, match="nested"):
        parse_hold_body(b'{"version": ' + b"[" * 1000 + b"]" * 1000 + b', "lease_s": 1}')


def test_json_depth_counts_outside_strings():
    assert json_depth(b'{"a": "[[[[{{{{", "b": [1, [2]]}') == 3
    assert json_depth(b'"\\"[[[["') == 0
    deep = b'{"metadata": ' + b'{"k": ' * (MAX_JSON_DEPTH - 1) + b"1" + b"}" * MAX_JSON_DEPTH
    assert parse_end_body(deep)[1]  # at the bound: accepted


def test_body_size_bounded():
    with pytest.raises(ControlRequestError) as ei:
        parse_end_body(b'{"metadata": {"x": "' + b"a" * 70_000 + b'"}}')
    assert ei.value.status == 413
