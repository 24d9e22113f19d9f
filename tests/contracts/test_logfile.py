import os
import signal
import subprocess
import sys
import textwrap

import pytest

from polar_contracts.episode_ids import episode_path
from polar_contracts.log.reader import read_episode, read_log
from polar_contracts.log.table import LogError
from polar_contracts.log.writer import EpisodeFinished, EpisodeWriter


def _write_growing(w, n, grow=50):
    prompt, rows = [], []
    for i in range(n):
        prompt = prompt + list(range(1000 + i * grow, 1000 + (i + 1) * grow))
        comp = [7, 8, 9, i]
        w.append_call(call_index=w.next_call_index(), prompt_ids=prompt, completion_ids=comp,
                      completion_logprobs=[-0.5] * 4, api="chat", stream=True)
        rows.append((list(prompt), comp))
        prompt = prompt + comp
    return rows


def test_roundtrip_full_prompts_and_compression(tmp_path):
    p = tmp_path / "ep1.arrow"
    w = EpisodeWriter(p, "ep1")
    rows = _write_growing(w, 20, grow=1500)
    df = read_log(p)
    assert df.height == 20
    assert [r for r in df["prompt_ids"].to_list()] == [r[0] for r in rows]
    assert df["completion_ids"].to_list() == [r[1] for r in rows]
    ep = read_episode(p)
    assert not ep.finished
    w.end(1.5, {"task": "t"})
    ep = read_episode(p)
    assert ep.finished and ep.reward == 1.5 and ep.metadata == {"task": "t"}
    # stored bytes grow linearly, not quadratically: about the distinct tokens, not every prompt
    distinct_tokens = len(rows[-1][0]) + 4
    assert os.path.getsize(p) < distinct_tokens * 4 * 1.5


def test_missing_ids_stay_null(tmp_path):
    p = tmp_path / "e.arrow"
    w = EpisodeWriter(p, "e")
    w.append_call(call_index=0, prompt_ids=None, completion_ids=None, completion_logprobs=None,
                  error="server returned no token ids")
    df = read_log(p)
    assert df["prompt_ids"][0] is None and df["completion_ids"][0] is None
    assert df["error"][0] == "server returned no token ids"


def test_reopen_appends_and_end_refuses_more(tmp_path):
    p = tmp_path / "e.arrow"
    w = EpisodeWriter(p, "e")
    _write_growing(w, 3)
    w.close()
    w2 = EpisodeWriter(p, "e")
    assert w2.next_call_index() == 3
    w2.append_call(call_index=3, prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-1.0])
    w2.end(0.0)
    assert read_log(p).height == 4
    with pytest.raises(EpisodeFinished):
        EpisodeWriter(p, "e")


def test_torn_tail_is_cut_and_earlier_rows_survive(tmp_path):
    p = tmp_path / "e.arrow"
    w = EpisodeWriter(p, "e")
    _write_growing(w, 5)
    with open(p, "ab") as f:  # a batch cut off mid-write
        f.write(b"\xff\xff\xff\xff\x10\x01\x00\x00garbage")
    ep = read_episode(p)
    assert ep.truncated and ep.calls.height == 5
    w2 = EpisodeWriter(p, "e")
    w2.append_call(call_index=5, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-1.0])
    ep = read_episode(p)
    assert ep.calls.height == 6 and not ep.truncated


def test_sigkill_mid_episode_keeps_completed_rows(tmp_path):
    p = tmp_path / "k.arrow"
    code = textwrap.dedent(f"""
        import sys, time
        from polar_contracts.log.writer import EpisodeWriter
        w = EpisodeWriter({str(p)!r}, "k")
        for i in range(10):
            w.append_call(call_index=i, prompt_ids=list(range(i * 10)), completion_ids=[i],
                          completion_logprobs=[-0.1])
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    df = read_log(p)
    assert df.height == 10 and df["prompt_ids"].to_list()[9] == list(range(90))


def test_garbage_file_is_a_clear_error(tmp_path):
    p = tmp_path / "bad.arrow"
    p.write_bytes(b"this is not arrow")
    with pytest.raises(LogError, match="bad.arrow"):
        read_log(p)


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".", "..", "x" * 129, "é", "a b"])
def test_episode_ids_never_escape(tmp_path, bad):
    with pytest.raises(ValueError, match="invalid episode id"):
        episode_path(tmp_path, bad)


def test_prepared_request_delta_is_used_only_against_its_own_base(tmp_path):
    """EpisodeWriter.prepare_request (computed while the server works) gives the same log as
    append_call computing the delta itself, also when another row was written in between."""
    from polar_contracts.log.reader import read_log
    from polar_contracts.log.writer import EpisodeWriter

    reqs = ['{"messages":["a"]}', '{"messages":["a","b"]}', '{"messages":["a","b","c"]}', '{"messages":["x"]}']
    w = EpisodeWriter(tmp_path / "p.arrow", "p")
    early = w.prepare_request(reqs[0])
    w.append_call(call_index=0, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1], request=reqs[0],
                  prepared_request=early)
    stale = w.prepare_request(reqs[2])  # prepared against reqs[0] ...
    w.append_call(call_index=1, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1], request=reqs[1],
                  prepared_request=w.prepare_request(reqs[1]))
    w.append_call(call_index=2, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1], request=reqs[2],
                  prepared_request=stale)  # ... but the base is reqs[1] now: computed again
    wrong = w.prepare_request(reqs[0])  # a prepared delta of another request is never used
    w.append_call(call_index=3, prompt_ids=[1], completion_ids=[2], completion_logprobs=[-0.1], request=reqs[3],
                  prepared_request=wrong)
    assert read_log(tmp_path / "p.arrow")["request"].to_list() == reqs


def _as_v2_stream(table) -> bytes:
    """The same rows as a schema-v2 proxy wrote them: without the sampling columns."""
    import pyarrow as pa

    from polar_contracts.sampling_fields import COLUMNS as SAMPLING_COLUMNS

    old = table.drop_columns(list(SAMPLING_COLUMNS))
    old = old.replace_schema_metadata({b"polar.log.schema_version": b"2"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old.schema) as w:
        for b in old.to_batches(max_chunksize=1):
            w.write_batch(b)
    return sink.getvalue().to_pybytes()


def test_sampling_columns_roundtrip_and_v2_logs_read_them_as_null(tmp_path):
    """Schema v3 rows carry the sampling columns; a v2 log (an older proxy) still reads, in every
    reader, with those columns null (unknown), and a v3 writer can append to it after a restart."""
    from polar_contracts.log.arrays import read_calls, read_head
    from polar_contracts.log.table import read_table

    p = tmp_path / "ep.arrow"
    w = EpisodeWriter(p, "ep")
    sampling = dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, logprobs_mode="processed",
                    sampling_unsupported="logit_bias")
    w.append_call(call_index=w.next_call_index(), prompt_ids=[1, 2, 3], completion_ids=[4], completion_logprobs=[-1.0],
                  api="chat", request='{"temperature": 0.7, "messages": []}', **sampling)
    w.close()
    df = read_log(p)
    assert {k: df[k][0] for k in sampling} == sampling
    assert {k: read_calls(p).calls[0].info[k] for k in sampling} == sampling

    table, _ = read_table(p)
    v2 = tmp_path / "old.arrow"
    v2.write_bytes(_as_v2_stream(table))
    df = read_log(v2)
    assert df["prompt_ids"].to_list() == [[1, 2, 3]]
    assert all(df[k][0] is None for k in sampling)
    info = read_calls(v2).calls[0].info
    # reconstruction falls back to what the request set (the server applied it); the rest is unknown
    assert info["temperature"] == 0.7 and all(info[k] is None for k in sampling if k != "temperature")
    w = EpisodeWriter(v2, "old")  # a restarted (v3) proxy appends to the v2 log
    w.append_call(call_index=w.next_call_index(), prompt_ids=[1, 2, 3, 4, 5], completion_ids=[6],
                  completion_logprobs=[-0.5], api="chat", **sampling)
    w.end(1.0)
    df = read_log(v2)
    assert df["prompt_ids"].to_list() == [[1, 2, 3], [1, 2, 3, 4, 5]]
    assert df["top_k"].to_list() == [None, 20]
    assert read_head(v2).finished
    (tmp_path / "oldend.arrow").write_bytes(_as_v2_stream(read_table(v2)[0].slice(0, 1))
                                            + _as_v2_stream(read_table(v2)[0].slice(2, 1)))
    assert read_head(tmp_path / "oldend.arrow").finished  # the end record is read from a v2 stream too


def test_v3_logs_read_sampling_source_as_null_and_v4_rows_carry_it(tmp_path):
    """Schema v4 added sampling_source; a v3 stream (an older proxy) reads with it null, every other
    column intact, and a v4 writer appends to it after a restart."""
    import pyarrow as pa

    from polar_contracts.log.arrays import read_calls
    from polar_contracts.log.table import read_table

    p = tmp_path / "ep.arrow"
    w = EpisodeWriter(p, "ep")
    src = "discovered: vllm GET /v1/models root -> /m/generation_config.json"
    w.append_call(call_index=w.next_call_index(), prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-1.0],
                  api="chat", request="{}", temperature=0.6, top_k=20, sampling_source=src)
    w.close()
    assert read_log(p)["sampling_source"].to_list() == [src] and read_calls(p).calls[0].info["sampling_source"] == src
    table, _ = read_table(p)
    old = table.drop_columns(["sampling_source"]).replace_schema_metadata({b"polar.log.schema_version": b"3"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old.schema) as s:
        for b in old.to_batches(max_chunksize=1):
            s.write_batch(b)
    v3 = tmp_path / "v3.arrow"
    v3.write_bytes(sink.getvalue().to_pybytes())
    df = read_log(v3)
    assert df["sampling_source"].to_list() == [None] and df["temperature"].to_list() == [0.6]
    w = EpisodeWriter(v3, "ep")
    w.append_call(call_index=w.next_call_index(), prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-1.0],
                  api="chat", request="{}", sampling_source="request")
    w.close()
    assert read_log(v3)["sampling_source"].to_list() == [None, "request"]
