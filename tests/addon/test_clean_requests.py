"""The incremental secret-key scan (redact.CleanRequests) finds exactly what a full scan finds,
over sequences of requests of one episode that share prefixes and suffixes."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from addon.call import SECRET_KEY_RE, SECRET_MATCH_MAX
from addon.redact import CleanRequests

# fragments that make near-misses and hits likely, cut anywhere by the edits below
PIECES = [b'{"model":"m","messages":[', b'"role":"user"', b'"content":"', b'"api_key"', b'"API-KEY"', b'"Authorization"',
          b'"authorizatio', b'n"', b'"x-api-key"', b'"access_token"', b'api_key', b'"', b'x' * 40, b'\xc3\xa9', b'}']


def edits():
    """(position fraction, bytes to delete, bytes to insert): how request k+1 differs from k."""
    return st.tuples(st.floats(0, 1), st.integers(0, 30), st.lists(st.sampled_from(PIECES), max_size=3).map(b"".join))


@settings(max_examples=600, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12).map(b"".join), st.lists(edits(), max_size=8))
def test_incremental_scan_equals_full_scan(first, steps):
    cache = CleanRequests(SECRET_KEY_RE, SECRET_MATCH_MAX)
    raw = first
    for frac, cut, ins in [(0.0, 0, b"")] + steps:
        at = int(frac * len(raw))
        raw = raw[:at] + ins + raw[at + cut:]
        assert cache.has_secret("e", raw) == (SECRET_KEY_RE.search(raw) is not None), raw


def test_other_episodes_do_not_vouch_for_each_other():
    cache = CleanRequests(SECRET_KEY_RE, SECRET_MATCH_MAX, max_episodes=2)
    clean = b'{"messages":[{"content":"' + b"x" * 100 + b'"}]}'
    assert not cache.has_secret("a", clean)
    with_key = clean[:-2] + b',"api_key":"k"}]}'
    assert cache.has_secret("b", with_key)  # b has no clean request yet: full scan
    assert cache.has_secret("a", with_key)  # a's clean request differs only at the end: found there
    for ep in ("c", "d", "e"):  # LRU: a is evicted, still correct
        cache.has_secret(ep, clean)
    assert cache.has_secret("a", with_key)
