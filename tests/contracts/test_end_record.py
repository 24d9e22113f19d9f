"""The end record contract (polar_contracts/log/end_record.py): its parser, its rules, and every
reader of a log (read_head, decode_log, read_calls, read_episode) seeing the same end record."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from polar_contracts.log import end_record as end
from polar_contracts.log.arrays import decode_log, read_calls
from polar_contracts.log.end_record import EndRecordError, group_of, is_discarded, parse_metadata, read_head
from polar_contracts.log.reader import read_episode
from polar_contracts.log.schema import KIND_CALL, KIND_END, SCHEMA
from polar_contracts.log.table import LogError, pack
from polar_contracts.log.writer import EpisodeWriter


def _raw_log(path, metadata_text: str | None) -> None:
    """A log written without the writer (which only writes JSON objects): one call, one end row."""
    rows = [
        {"kind": KIND_CALL, "episode_id": path.stem, "call_index": 0, "choice": 0, "api": "chat",
         "prompt_base_row": -1, "prompt_base_len": 0, "prompt_tail_zstd": pack(np.arange(3, dtype="<i4").tobytes()),
         "completion_ids": [7], "completion_logprobs": [-0.5], "request_zstd": pack(b"{}"),
         "request_prefix_len": 0, "request_suffix_len": 0},
        {"kind": KIND_END, "episode_id": path.stem, "reward": 1.0, "metadata": metadata_text},
    ]
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, SCHEMA) as w:
        for r in rows:
            w.write_batch(pa.RecordBatch.from_pylist([r], schema=SCHEMA))


@pytest.mark.parametrize("text", ["[1, 2]", '"discard"', "3", "null", "{not json", "true"])
def test_every_reader_refuses_end_metadata_that_is_not_an_object(tmp_path, text):
    path = tmp_path / "bad.arrow"
    _raw_log(path, text)
    for reader in (read_head, decode_log, read_calls, read_episode):
        with pytest.raises(LogError, match=r"bad\.arrow: end record metadata is not (JSON|a JSON object)"):
            reader(path)


def test_the_parser_names_the_file_and_what_it_got():
    with pytest.raises(EndRecordError, match=r"x\.arrow: end record metadata is not a JSON object \(got list"):
        parse_metadata("[1]", "x.arrow")
    with pytest.raises(EndRecordError, match=r"x\.arrow: end record metadata is not JSON"):
        parse_metadata("{", "x.arrow")
    assert parse_metadata("", "x.arrow") == {} and parse_metadata(None, "x.arrow") == {}
    assert parse_metadata('{"a": 1}', "x.arrow") == {"a": 1}
    assert issubclass(EndRecordError, LogError)  # callers that catch LogError keep working


def test_discard_rule_is_true_only():
    assert is_discarded({end.DISCARD: True})
    for value in (False, None, 1, "true", "yes", [True]):
        assert not is_discarded({end.DISCARD: value}), value
    assert not is_discarded({})


def test_group_of():
    assert group_of({end.GROUP_ID: "t1"}, "e1") == "t1"
    assert group_of({end.GROUP_ID: 7}, "e1") == "7"
    assert group_of({}, "e1") == "e1"
    assert group_of({end.GROUP_ID: "t1"}, "e1", "episode") == "e1"
    assert group_of({end.TASK_ID: "t9", end.GROUP_ID: "g"}, "e1", end.TASK_ID) == "t9"
    with pytest.raises(KeyError, match="episode e1: metadata has no 'task_id' to group by"):
        group_of({end.GROUP_ID: "g"}, "e1", end.TASK_ID)


def test_the_key_types_cover_every_key():
    keys = {v for k, v in vars(end).items() if k.isupper() and not k.startswith("KIND_") and isinstance(v, str)}
    assert keys == set(end.KEY_TYPES), keys ^ set(end.KEY_TYPES)


def _episode(path, *, finish: bool):
    w = EpisodeWriter(path, path.stem)
    prompt = list(range(100, 140))
    for i in range(4):
        request = json.dumps({"messages": [{"role": "system", "content": "Title this chat" if i == 2 else "agent"}],
                              "pad": "x" * 50, "turn": i})
        w.append_call(call_index=w.next_call_index(), prompt_ids=prompt, completion_ids=[7, 8, i],
                      completion_logprobs=[-0.1, -0.2, -0.3], request=request, response="{}", api="chat")
        prompt = prompt + [7, 8, i] + [200 + i] * 5
    if finish:
        w.end(0.5, {end.GROUP_ID: "g1", end.TASK_ID: "t1", end.HARNESS: "h",
                    end.AUXILIARY_RULES: [{"name": "title", "match": {"system_contains": "Title this"}}]})
    else:
        w.close()


@pytest.mark.parametrize("finish", [True, False])
def test_the_views_agree_on_prompts_auxiliary_flags_and_the_end_record(tmp_path, finish):
    path = tmp_path / "e1.arrow"
    _episode(path, finish=finish)
    head, decoded, calls, frame = read_head(path), decode_log(path), read_calls(path), read_episode(path)
    ends = {(head.finished, head.reward, json.dumps(head.metadata, sort_keys=True)),
            (decoded.end.finished, decoded.end.reward, json.dumps(decoded.end.metadata, sort_keys=True)),
            (calls.finished, calls.reward, json.dumps(calls.metadata, sort_keys=True)),
            (frame.finished, frame.reward, json.dumps(frame.metadata, sort_keys=True))}
    assert len(ends) == 1, ends
    assert head.finished is finish
    assert head.metadata.get(end.GROUP_ID) == ("g1" if finish else None)
    assert head.n_calls == len(calls.calls) == frame.calls.height == 4
    assert [c.prompt.tolist() for c in calls.calls] == frame.calls["prompt_ids"].to_list()
    assert [s[:n].tolist() for s, n in zip(decoded.seqs, decoded.prompt_lens)] == frame.calls["prompt_ids"].to_list()
    assert [c.completion.tolist() for c in calls.calls] == frame.calls["completion_ids"].to_list()
    flags = [bool(c.info["auxiliary"]) for c in calls.calls]
    assert flags == [bool(a) for a in frame.calls["auxiliary"].to_list()]  # null: not flagged
    # the recipe's rule (in the end record) flags the title call: only once the record is there
    assert flags == ([False, False, True, False] if finish else [False] * 4)
    assert calls.requests == [] and read_calls(path, with_requests=True).requests == frame.calls["request"].to_list()


def test_polar_recon_keeps_only_the_documented_readers():
    import polar_recon
    from polar_contracts.log import reader

    assert polar_recon.read_log is reader.read_log and polar_recon.read_episode is reader.read_episode
    for gone in ("EpisodeWriter", "LogError", "EpisodeLog", "validate_episode_id"):
        with pytest.raises(AttributeError):
            getattr(polar_recon, gone)
