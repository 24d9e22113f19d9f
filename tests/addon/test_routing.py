import pytest

from addon.routing import RouteError, api_of, route
from polar_contracts.control import ControlRequestError, parse_end_body


def test_header_wins_over_prefix_and_option():
    r = route("POST", "/polar/ep-b/v1/chat/completions", {"x-polar-episode": "ep-a"}, "default")
    assert r.episode_id == "ep-a" and r.path == "/v1/chat/completions" and not r.is_end


def test_prefix_stripped_and_option_default():
    assert route("POST", "/polar/e1/v1/completions?x=1", {}, "d").path == "/v1/completions?x=1"
    assert route("POST", "/v1/completions", {}, "d").episode_id == "d"


@pytest.mark.parametrize("bad", ["../etc", "a b", "x" * 129, "..", "é"])
def test_invalid_ids_are_400_with_a_clear_message(bad):
    with pytest.raises(RouteError, match="invalid episode id") as ei:
        route("POST", "/v1/chat/completions", {"x-polar-episode": bad}, "d")
    assert ei.value.status == 400


def test_invalid_prefix_id():
    with pytest.raises(RouteError, match="path prefix"):
        route("POST", "/polar/a%2Fb/v1/chat/completions", {}, "d")


def test_end_endpoint():
    r = route("POST", "/polar/ep1/end", {}, "d")
    assert r.is_end and r.episode_id == "ep1"
    with pytest.raises(RouteError) as ei:
        route("GET", "/polar/ep1/end", {}, "d")
    assert ei.value.status == 405


def test_api_of():
    assert api_of("POST", "/v1/chat/completions") == "chat"
    assert api_of("POST", "/v1/completions?a=b") == "completions"
    assert api_of("GET", "/v1/chat/completions") is None
    assert api_of("POST", "/v1/models") is None


def test_end_body():
    assert parse_end_body(b'{"reward": 1, "metadata": {"k": 2}}') == (1.0, {"k": 2})
    assert parse_end_body(b"") == (None, {})
    for bad, msg in [(b"{", "not valid JSON"), (b"[]", "JSON object"), (b'{"reward": "x"}', "number"),
                     (b'{"rewrd": 1}', "unknown keys"), (b'{"metadata": 3}', "metadata")]:
        with pytest.raises(ControlRequestError, match=msg):
            parse_end_body(bad)
