"""The incremental SSE parser: any chunking gives the same events with the same raw bytes."""
from hypothesis import given, settings
from hypothesis import strategies as st

from addon.sse import SSEParser, _blank_line, parse_event

STREAM = (
    b": keep-alive\n\n"
    b"data: {\"a\": \"h\xc3\xa9llo \xf0\x9f\x98\x80\"}\r\n\r\n"
    b"event: sglext_ids\ndata: {\"x\": 1}\n\n"
    b"data: line1\r\ndata: line2\r\r"
    b"data: [DONE]\n\n"
)


def _events(chunks):
    p = SSEParser()
    out = []
    for c in chunks:
        out += p.feed(c)
    return out + p.close()


def test_whole_stream():
    evs = _events([STREAM])
    assert [e.data for e in evs] == [None, '{"a": "héllo 😀"}', '{"x": 1}', "line1\nline2", "[DONE]"]
    assert evs[0].comments == ["keep-alive"]
    assert evs[2].event == "sglext_ids"
    assert evs[1].newline == b"\r\n"
    assert b"".join(e.raw for e in evs) == STREAM


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_split_same_events(cuts):
    cuts = sorted(set(cuts))
    chunks = [STREAM[a:b] for a, b in zip([0] + cuts, cuts + [len(STREAM)], strict=True)]
    evs = _events(chunks)
    assert [e.data for e in evs] == [e.data for e in _events([STREAM])]
    assert b"".join(e.raw for e in evs) == STREAM


def test_utf8_split_inside_character():
    body = 'data: {"t": "日本"}\n\n'.encode()
    cut = body.index("本".encode()) + 1  # in the middle of a 3-byte character
    p = SSEParser()
    assert p.feed(body[:cut]) == []
    (ev,) = p.feed(body[cut:])
    assert ev.data == '{"t": "日本"}'


def test_crlf_split_between_cr_and_lf():
    p = SSEParser()
    assert p.feed(b"data: 1\r\n\r") == []  # the last CR may be half of a CRLF
    (ev,) = p.feed(b"\ndata: 2\n\n")[:1]
    assert ev.raw == b"data: 1\r\n\r\n" and ev.data == "1"


def test_unterminated_tail_on_close():
    p = SSEParser()
    assert p.feed(b"data: x") == []
    (ev,) = p.close()
    assert ev.data == "x"
    assert p.close() == []


def test_field_without_space_and_unknown_fields():
    ev = parse_event(b"data:{}\nid: 3\nretry: 10\n\n")
    assert ev.data == "{}"


def test_big_event_in_many_reads_and_one_line_fast_path():
    """A 100 KB ids event arriving in 1 KB reads (the search resumes where the last read ended)
    gives the same event as parse_event; one-line data events keep their exact data bytes."""
    big = b"data: {\"prompt_token_ids\":[" + b",".join(b"%d" % i for i in range(20000)) + b"]}\n\n"
    tail = b"data:  two spaces\n\ndata: a\ndata: b\n\ndata: x\nid: 1\n\n"
    stream = big + tail
    p = SSEParser()
    evs = []
    for i in range(0, len(stream), 1024):
        evs += p.feed(stream[i:i + 1024])
    assert p.pending == b""
    want = [parse_event(big)] + [parse_event(r + b"\n\n") for r in tail.split(b"\n\n")[:-1]]
    assert [(e.raw, e.data_bytes, e.event, e.comments, e.newline) for e in evs] == \
        [(e.raw, e.data_bytes, e.event, e.comments, e.newline) for e in want]
    assert [e.data_bytes for e in evs[1:]] == [b" two spaces", b"a\nb", b"x"]


@settings(max_examples=500)
@given(st.binary(max_size=64).map(lambda b: b.replace(b"\r", b""))
       | st.lists(st.sampled_from([b"a", b"\n", b"1,", b"\n\n"]), max_size=40).map(b"".join),
       st.integers(min_value=0, max_value=70))
def test_blank_line_search_is_bytes_find(buf, start):
    assert _blank_line(buf, start, len(buf)) == buf.find(b"\n\n", start)
