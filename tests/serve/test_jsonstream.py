"""JsonScanner: every prefix of a raw JSON text maps to a prefix of its final re-serialization."""
from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from polar_serve.jsonstream import JsonScanner

TEXT = (st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
        | st.sampled_from(["é", "😀", '\n\t"\\/', "\x01\x1f", "</tool_call>", "a\u2028b", "{[,:]}"]))
SCALAR = (st.none() | st.booleans() | st.integers(-10**20, 10**20)
          | st.floats(allow_nan=False, allow_infinity=False) | TEXT)
VALUE = st.recursive(SCALAR, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(TEXT, ch, max_size=4),
                     max_leaves=12)
STYLES = [lambda v: json.dumps(v), lambda v: json.dumps(v, ensure_ascii=False),
          lambda v: json.dumps(v, separators=(",", ":")), lambda v: json.dumps(v, indent=2)]


@settings(max_examples=300, deadline=None)
@given(value=VALUE, style=st.integers(0, len(STYLES) - 1))
def test_every_prefix_is_a_prefix_of_the_final_serialization(value, style):
    raw = STYLES[style](value) + "}\n</tool_call>"  # what follows the arguments in a tool call
    want = json.dumps(value, ensure_ascii=False)
    sc, prev = JsonScanner(), ""
    for i in range(len(raw) + 1):
        out = sc.feed(raw[:i])
        assert want.startswith(out) and out.startswith(prev), (raw[:i], out, want)
        prev = out
    assert sc.done and sc.error is None and out == want
    assert raw[sc.end:] == "}\n</tool_call>"


def test_incomplete_tokens_are_held_back():
    assert JsonScanner().feed('{"n": 12') == '{"n": '           # 12 may still become 123 or 12.5
    assert JsonScanner().feed('{"s": "a\\') == '{"s": "a'       # half an escape
    assert JsonScanner().feed('{"s": "a\\u00') == '{"s": "a'
    assert JsonScanner().feed('{"s": "\\ud83d') == '{"s": "'    # a surrogate pair may follow
    assert JsonScanner().feed('{"s": "\\ud83d\\ude00') == '{"s": "😀'
    assert JsonScanner().feed('{"b": tru') == '{"b": '
    assert JsonScanner().feed('{"b": true ') == '{"b": true'
    assert JsonScanner().feed('{"k') == '{'                      # keys go out whole


def test_members_and_errors():
    sc = JsonScanner()
    sc.feed('{"name": "b\\u0061sh", "arguments": {"x": [1, 2]}} trailing')
    assert sc.done and sc.members["name"].string == "bash"
    a = sc.members["arguments"]
    assert sc.raw[a.start:a.end] == '{"x": [1, 2]}'
    for bad in ('{"a": tx}', '{"a" 1}', '{"a": 1]', '{"a": "x\ny"}', '{"a": 01}', '{"a": "\\q"}'):
        sc = JsonScanner()
        sc.feed(bad)
        assert sc.error and not sc.done, bad


def test_the_scanner_restarts_when_the_text_changes_under_it():
    sc = JsonScanner()
    sc.feed('{"a": "xy')
    assert sc.feed('{"b": 1, ') == '{"b": 1, '
