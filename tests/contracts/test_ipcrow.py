"""The log writer's own one-row IPC encoder (polar_contracts/log/ipcrow.py) against pyarrow: every row it
writes must read back through pyarrow exactly as pyarrow's own encoding of that row."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polar_contracts.log.writer as logwriter
from polar_contracts.log.ipcrow import EOS, RowEncoder, schema_message
from polar_contracts.log.reader import read_log
from polar_contracts.log.schema import SCHEMA
from polar_contracts.log.table import read_batches
from polar_contracts.log.writer import EpisodeWriter

ENC = RowEncoder(SCHEMA)

i32 = st.integers(-(2**31), 2**31 - 1)
f32 = st.floats(width=32, allow_nan=False)
text = st.text(max_size=40)  # any code point but surrogates (not encodable as UTF-8)


def value_of(field: pa.Field):
    t = field.type
    if pa.types.is_string(t):
        return text
    if pa.types.is_binary(t):
        return st.binary(max_size=64)
    if pa.types.is_int32(t):
        return i32
    if pa.types.is_float64(t):
        return st.floats(allow_nan=False)
    if pa.types.is_boolean(t):
        return st.booleans()
    if t == pa.list_(pa.int32()):
        return st.lists(i32, max_size=30).map(lambda xs: np.array(xs, dtype=np.int32))
    if t == pa.list_(pa.float32()):  # a list, or a float32 array (the writer's fast path)
        return st.lists(f32, max_size=30) | st.lists(f32, max_size=30).map(lambda xs: np.array(xs, dtype=np.float32))
    if t == pa.list_(pa.string()):
        return st.lists(text, max_size=5)
    raise AssertionError(f"no strategy for {t}")


rows = st.fixed_dictionaries({}, optional={f.name: st.none() | value_of(f) for f in SCHEMA})


def pyarrow_table(rs: list[dict]) -> pa.Table:
    plain = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()} for r in rs]
    return pa.Table.from_pylist(plain, schema=SCHEMA)


def read_stream(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.py_buffer(data)).read_all()


@settings(max_examples=300, deadline=None)
@given(st.lists(rows, min_size=1, max_size=4))
def test_rows_read_back_as_pyarrow_encodes_them(rs):
    data = schema_message(SCHEMA) + b"".join(ENC.encode(r) for r in rs) + EOS
    got = read_stream(data)
    got.validate(full=True)
    expected = pyarrow_table(rs)
    assert got.to_pylist() == expected.to_pylist()
    assert got.equals(expected)


def test_layout_matches_pyarrow_field_nodes_and_buffers():
    """Same node count, buffer count and body length rule as pyarrow's own message."""
    r = dict(kind="call", call_index=7, notes=["a", "bé"], completion_ids=np.arange(5, dtype=np.int32),
             completion_logprobs=np.full(5, -0.5, dtype=np.float32), stream=True, t_start=1.25,
             request_zstd=b"\x00\x01", model=None)
    ours = ENC.encode(r)
    theirs = pa.RecordBatch.from_pylist([{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in r.items()}],
                                        schema=SCHEMA).serialize().to_pybytes()
    a = pa.ipc.read_message(pa.py_buffer(ours))
    b = pa.ipc.read_message(pa.py_buffer(theirs))
    assert a.type == b.type == "record batch"
    assert a.body.size % 8 == 0 and len(ours) % 8 == 0
    batch = pa.ipc.read_record_batch(a, SCHEMA)
    assert batch.equals(pa.ipc.read_record_batch(b, SCHEMA))


@pytest.mark.parametrize("row, err", [
    ({"call_index": 2**31}, OverflowError),
    ({"call_index": 1.5}, TypeError),
    ({"call_index": True}, TypeError),
    ({"stream": 1}, TypeError),
    ({"kind": b"call"}, TypeError),
    ({"request_zstd": "text"}, TypeError),
    ({"kind": "\ud800"}, UnicodeEncodeError),
    ({"notes": ["a", None]}, TypeError),
])
def test_bad_values_are_refused_naming_the_column(row, err):
    with pytest.raises(err):
        ENC.encode(row)


def test_failed_write_is_cut_off_and_later_rows_stay_readable(tmp_path, monkeypatch):
    """A write that fails half way (disk full) must not leave a torn message in front of the
    rows written after it: the reader stops at the first torn message."""
    path = tmp_path / "e.arrow"
    w = EpisodeWriter(path, "e")
    w.append_call(call_index=0, prompt_ids=[1, 2, 3], completion_ids=[4], completion_logprobs=[-0.1], status=200)
    real_write = os.write
    calls = {"n": 0}

    def half_then_fail(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            real_write(fd, bytes(data[: len(data) // 2]))
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(logwriter.os, "write", half_then_fail)
    with pytest.raises(OSError):
        w.append_call(call_index=1, prompt_ids=[1, 2, 3, 4, 5], completion_ids=[6], completion_logprobs=[-0.2], status=200)
    monkeypatch.setattr(logwriter.os, "write", real_write)
    w.append_call(call_index=2, prompt_ids=[1, 2, 3, 4, 5, 6, 7], completion_ids=[8], completion_logprobs=[-0.3], status=200)
    _, _, torn, _ = read_batches(path)
    assert not torn
    df = read_log(path)
    assert df["call_index"].to_list() == [0, 2]
    assert df["prompt_ids"].to_list() == [[1, 2, 3], [1, 2, 3, 4, 5, 6, 7]]
    w.end(1.0)
    assert read_batches(path)[3] is False  # closed with the end-of-stream marker
