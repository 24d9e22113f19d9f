"""The public numpy-level reader of polar_contracts/log/table.py agrees with read_log."""
from __future__ import annotations

import numpy as np

from polar_contracts.log.reader import read_log
from polar_contracts.log.schema import KIND_CALL
from polar_contracts.log.table import full_prompt_arrays, full_requests, read_batches, read_table, unpack
from polar_contracts.log.writer import EpisodeWriter


def test_public_reader_matches_read_log(tmp_path):
    path = tmp_path / "e1.arrow"
    w = EpisodeWriter(path, "e1", keep=4)
    prompt = np.arange(100, dtype=np.int32)
    for i in range(3):
        w.append_call(call_index=i, prompt_ids=prompt, completion_ids=np.array([7, 8], dtype=np.int32),
                      completion_logprobs=np.array([-0.1, -0.2], dtype=np.float32),
                      request=f'{{"turn": {i}, "pad": "{"x" * 200}"}}', response="{}", api="chat")
        prompt = np.concatenate([prompt, [7, 8], np.arange(5, dtype=np.int32) + i])
    w.append_call(call_index=3, prompt_ids=None, completion_ids=None, completion_logprobs=None,
                  error="server returned no prompt token ids", request=None)
    w.end(1.0, {})
    batches, good_end, torn, open_stream = read_batches(path)
    assert len(batches) == 5 and good_end == path.stat().st_size and not torn and not open_stream
    table, torn = read_table(path)
    calls = table.filter(table.column("kind").to_numpy(zero_copy_only=False) == KIND_CALL)
    arrays = full_prompt_arrays(calls)
    df = read_log(path)
    assert [None if a is None else a.tolist() for a in arrays] == df["prompt_ids"].to_list()
    assert all(a.dtype == np.int32 for a in arrays if a is not None)
    assert full_requests(calls) == df["request"].to_list()
    assert unpack(calls.column("response_zstd")[0].as_py()) == b"{}"
    assert read_table(path, ["kind"])[0].column_names == ["kind"]
