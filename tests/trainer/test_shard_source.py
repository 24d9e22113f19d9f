"""ShardSource: landing order, temp names, cursor restart, lag filter, fsspec URIs, bad shards."""
from __future__ import annotations

import os
import uuid

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from polar_contracts.shards import shard_seq
from tests.trainer.shardkit import SHARD_SCHEMA, row, synthetic_seq, write_shard
from trainer.shard_source import (
    CURSOR_FILE,
    NoShardsError,
    ShardCursor,
    ShardFormatError,
    ShardSource,
    parse_version,
)


def seq(k: int) -> dict:
    return synthetic_seq([1, 2, 3], [100 + k, 200 + k])


def groups_rows(names: list[str], per_group: int = 2, version: str | None = "1") -> list[dict]:
    return [row(seq(i), f"{g}-e{i}", g, float(i), group_size=per_group, weight_version=version)
            for g in names for i in range(per_group)]


def drain(src: ShardSource) -> list[str]:
    out = []
    while (g := src.try_next()) is not None:
        out.append(g.group_id)
    return out


def test_names():
    assert shard_seq("shard-000012.parquet") == 12
    for bad in (".shard-000012.parquet.tmp", "shard-000012.parquet.tmp", "shard-x.parquet", "shard-1.parquetx"):
        assert shard_seq(bad) is None
    assert parse_version("7") == 7 and parse_version(None) is None and parse_version("v7") is None


def test_landing_order_and_temp_files_ignored(tmp_path):
    write_shard(tmp_path, 2, groups_rows(["c"]))
    write_shard(tmp_path, 1, groups_rows(["a", "b"]))
    # A shard still being written: a temporary name, never read (it is not even valid parquet).
    (tmp_path / ".shard-000003.parquet.tmp").write_bytes(b"PAR1 half written")
    (tmp_path / "notes.txt").write_text("x")
    src = ShardSource(str(tmp_path))
    assert drain(src) == ["a", "b", "c"]  # by sequence number within one listing
    # Landing later means coming later, whatever the number.
    write_shard(tmp_path, 0, groups_rows(["late-low-number"]))
    os.replace(tmp_path / ".shard-000003.parquet.tmp", tmp_path / "junk")
    write_shard(tmp_path, 3, groups_rows(["d"]))
    assert drain(src) == ["late-low-number", "d"]
    assert drain(src) == []
    assert src.stats.shards_read == 4


def test_group_rows_in_shard_order(tmp_path):
    rows = groups_rows(["a", "b"])
    rows = [rows[0], rows[2], rows[1], rows[3]]  # interleaved groups
    write_shard(tmp_path, 1, rows)
    g1, g2 = ShardSource(str(tmp_path)).take(2, timeout=0)
    assert (g1.group_id, [r["episode_id"] for r in g1.rows]) == ("a", ["a-e0", "a-e1"])
    assert (g2.group_id, [r["episode_id"] for r in g2.rows]) == ("b", ["b-e0", "b-e1"])


@pytest.mark.parametrize("stop_after", [0, 1, 2, 3, 4, 5])
def test_cursor_restart_neither_repeats_nor_skips(tmp_path, stop_after):
    write_shard(tmp_path, 1, groups_rows(["a", "b", "c"]))
    write_shard(tmp_path, 2, groups_rows(["d", "e"]))
    src = ShardSource(str(tmp_path))
    first = [src.next_group(timeout=0).group_id for _ in range(stop_after)]
    ckpt = tmp_path / "checkpoint-7"
    ckpt.mkdir()
    src.cursor.save(ckpt)
    assert (ckpt / CURSOR_FILE).is_file()
    write_shard(tmp_path, 3, groups_rows(["f"]))  # lands while the trainer is down
    resumed = ShardSource(str(tmp_path), cursor=ShardCursor.load(ckpt))
    rest = drain(resumed)
    assert first + rest == ["a", "b", "c", "d", "e", "f"]


def test_cursor_json_roundtrip_and_errors(tmp_path):
    c = ShardCursor(["shard-000001.parquet"], "shard-000002.parquet", 3)
    assert ShardCursor.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="not a shard cursor"):
        ShardCursor.from_json("[1, 2]")
    with pytest.raises(FileNotFoundError, match="no shard cursor"):
        ShardCursor.load(tmp_path)


def test_policy_lag_filter(tmp_path):
    rows = (groups_rows(["v1"], version="1") + groups_rows(["v3"], version="3")
            + groups_rows(["v5"], version="5") + groups_rows(["nov"], version=None))
    mixed = groups_rows(["mixed"], version="5")
    mixed[1]["weight_version"] = "2"  # the oldest row sets the group's version
    write_shard(tmp_path, 1, rows + mixed)
    src = ShardSource(str(tmp_path), max_policy_lag=2)
    src.set_current_version("6")  # what the last /polar/reload answered
    assert drain(src) == ["v5"]
    # the versionless group is the oldest (VersionOrder.lag): 6 syncs behind, dropped for its lag
    assert src.stats.dropped == {"policy_lag": 4}
    with pytest.raises(NoShardsError, match="groups dropped .*'policy_lag': 4"):
        src.next_group(timeout=0)
    # Without a synced version the newest version seen in the data is "current".
    src2 = ShardSource(str(tmp_path), max_policy_lag=2)
    assert drain(src2) == ["v3", "v5"]
    # No lag bound: everything, versionless included.
    assert len(drain(ShardSource(str(tmp_path)))) == 5


def test_incomplete_groups(tmp_path):
    rows = groups_rows(["ok"]) + [dict(r, group_complete=False) for r in groups_rows(["timedout"])]
    write_shard(tmp_path, 1, rows)
    assert drain(ShardSource(str(tmp_path))) == ["ok", "timedout"]
    src = ShardSource(str(tmp_path), drop_incomplete=True)
    assert drain(src) == ["ok"] and src.stats.dropped == {"incomplete": 1}


def test_wait_timeout_and_blocking(tmp_path):
    src = ShardSource(str(tmp_path / "not-yet"), poll_interval=0.01)
    with pytest.raises(NoShardsError, match="no complete group"):
        src.next_group(timeout=0.05)
    write_shard(tmp_path / "not-yet", 1, groups_rows(["a"]))
    assert src.next_group(timeout=1).group_id == "a"


def test_memory_fsspec_uri():
    import fsspec

    base = f"/polar-test-{uuid.uuid4().hex}"
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    write_shard(base, 1, groups_rows(["m1", "m2"]), filesystem=fs)
    src = ShardSource(f"memory://{base}")
    assert drain(src) == ["m1", "m2"]
    write_shard(base, 2, groups_rows(["m3"]), filesystem=fs)
    assert drain(src) == ["m3"]


def test_file_uri(tmp_path):
    write_shard(tmp_path, 1, groups_rows(["f"]))
    assert drain(ShardSource(f"file://{tmp_path}")) == ["f"]


def test_bad_shards_name_the_problem(tmp_path):
    bad = groups_rows(["a"])
    bad[1]["logprobs"] = bad[1]["logprobs"][:-1]
    write_shard(tmp_path / "len", 1, bad)
    with pytest.raises(ShardFormatError, match=r"shard-000001.parquet row 1 .*logprobs has 4 entries, input_ids has 5"):
        ShardSource(str(tmp_path / "len")).try_next()
    bad = groups_rows(["a"])
    bad[0]["prompt_len"] = 1
    write_shard(tmp_path / "plen", 1, bad)
    with pytest.raises(ShardFormatError, match="prompt_len 1 is not the index of the first loss_mask=1"):
        ShardSource(str(tmp_path / "plen")).try_next()
    (tmp_path / "cols").mkdir()
    pq.write_table(pa.table({"episode_id": ["x"]}), tmp_path / "cols" / "shard-000001.parquet")
    with pytest.raises(ShardFormatError, match=r"missing columns \['group_id'"):
        ShardSource(str(tmp_path / "cols")).try_next()


def test_schema_is_the_contract():
    # The columns the contract fixes, with their types; shardkit writes exactly these.
    assert SHARD_SCHEMA.field("loss_mask").type == pa.list_(pa.int8())
    assert SHARD_SCHEMA.field("logprobs").type == pa.list_(pa.float32())
    assert SHARD_SCHEMA.field("weight_version").nullable


def test_ranks_partition_and_resume_per_rank(tmp_path):
    write_shard(tmp_path, 1, groups_rows(["a", "b", "c"]))
    write_shard(tmp_path, 2, groups_rows(["d", "e"]))
    write_shard(tmp_path, 3, groups_rows(["f"]))
    ranks = [ShardSource(str(tmp_path), rank=r, world_size=2) for r in range(2)]
    got = [drain(s) for s in ranks]
    # owner = (shard seq + index in shard) % 2: shard 1 -> b (0), a c (1); shard 2 -> d (0), e (1); shard 3 -> f (1)
    assert got == [["b", "d"], ["a", "c", "e", "f"]]
    assert set(got[0]).isdisjoint(got[1]) and set(got[0]) | set(got[1]) == set("abcdef")
    assert ShardSource(str(tmp_path), rank=0, world_size=1).world_size == 1 and drain(
        ShardSource(str(tmp_path))) == list("abcdef")
    # Each rank resumes its own partition from its own cursor file; another world size is refused.
    r1 = ShardSource(str(tmp_path), rank=1, world_size=2)
    assert [r1.try_next().group_id for _ in range(2)] == ["a", "c"]
    path = r1.cursor.save(tmp_path)
    assert path.name == "polar_shard_cursor.rank1.json"
    resumed = ShardSource(str(tmp_path), rank=1, world_size=2, cursor=ShardCursor.load(tmp_path, 1, 2))
    assert drain(resumed) == ["e", "f"]
    with pytest.raises(ValueError, match="rank 1 of 2, not 1 of 3"):
        ShardCursor.load(tmp_path, 1, 3)
    with pytest.raises(FileNotFoundError, match="rank 2 of 3"):
        ShardCursor.load(tmp_path, 2, 3)
    with pytest.raises(ValueError, match="partition differs"):
        ShardSource(str(tmp_path), rank=0, world_size=2, cursor=ShardCursor.load(tmp_path, 1, 2))
    with pytest.raises(ValueError, match="rank 2 of world_size 2"):
        ShardSource(str(tmp_path), rank=2, world_size=2)


def test_push_back_hands_the_group_out_again_and_keeps_the_cursor_before_it(tmp_path):
    write_shard(tmp_path, 1, groups_rows(["a", "b"]))
    src = ShardSource(str(tmp_path))
    assert src.try_next().group_id == "a"
    b = src.try_next()
    assert src.cursor == ShardCursor(["shard-000001.parquet"], None, 0)  # b was the shard's last group
    src.push_back(b)
    assert src.cursor == ShardCursor([], "shard-000001.parquet", 1)  # a checkpoint now would not count b
    with pytest.raises(RuntimeError, match="push_back"):
        src.push_back(b)
    assert src.try_next() is b and src.stats.groups_out == 2
    assert src.try_next() is None


def test_a_wait_for_shards_says_so(tmp_path, caplog):
    """A mistyped --shards does not wait in silence: a missing location is named at once, and every
    wait_report_interval the wait says where, how long and what was seen."""
    import logging

    src = ShardSource(str(tmp_path / "typo"), poll_interval=0.01, wait_report_interval=0.05)
    with caplog.at_level(logging.WARNING, logger="trainer.shard_source"), pytest.raises(NoShardsError):
        src.next_group(timeout=0.2)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for shards in")]
    assert len(lines) >= 2, caplog.text
    assert lines[0].startswith(f"waiting for shards in {tmp_path / 'typo'} (0s; 0 shards seen")
    assert "does not exist yet; polar-recon build/watch LOGDIR" in lines[0]
    caplog.clear()
    (tmp_path / "there").mkdir()
    src = ShardSource(str(tmp_path / "there"), poll_interval=0.01, wait_report_interval=60)
    with caplog.at_level(logging.WARNING, logger="trainer.shard_source"), pytest.raises(NoShardsError):
        src.next_group(timeout=0.1)
    assert "waiting for shards" not in caplog.text  # an existing directory: only every wait_report_interval
