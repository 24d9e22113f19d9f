"""A rollout shows itself while it runs: `polar-rollout run --report-to tensorboard` writes TensorBoard
event files (harness_recipes/node/run_metrics.py, tb_events.py), checked here with a reader written
from the format's description (TFRecord framing with masked CRC-32C, the Event / Summary protobufs),
not with the writer's own code."""
from __future__ import annotations

import struct
from pathlib import Path

import pyarrow.compute as pc

from harness_recipes.node.run_metrics import call_numbers
from polar_contracts.log.table import read_table
from tests.recon import logs as L

from .conftest import fake_recipe, write_tasks
from .test_cli import base_args, cli


def crc32c_bitwise(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 * (c & 1))
    return c ^ 0xFFFFFFFF


def masked(data: bytes) -> int:
    c = crc32c_bitwise(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def fields(buf: bytes) -> list[tuple[int, object]]:
    out, i = [], 0
    while i < len(buf):
        key, i = varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            v, i = varint(buf, i)
        elif wire == 1:
            v, i = buf[i:i + 8], i + 8
        elif wire == 5:
            v, i = buf[i:i + 4], i + 4
        else:
            n, i = varint(buf, i)
            v, i = buf[i:i + n], i + n
        out.append((number, v))
    return out


def read_events(path: Path) -> list[dict]:
    """Every event of a TensorBoard event file: {wall_time, step, file_version | scalars}."""
    data, i, events = path.read_bytes(), 0, []
    while i < len(data):
        head = data[i:i + 8]
        (n,) = struct.unpack("<Q", head)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked(head), "length CRC"
        body = data[i + 12:i + 12 + n]
        assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked(body), "data CRC"
        i += 16 + n
        ev: dict = {"step": 0}
        for number, v in fields(body):
            if number == 1:
                ev["wall_time"] = struct.unpack("<d", v)[0]
            elif number == 2:
                ev["step"] = v
            elif number == 3:
                ev["file_version"] = v.decode()
            elif number == 5:
                ev["scalars"] = {}
                for _, value in fields(v):
                    f = dict(fields(value))
                    ev["scalars"][f[1].decode()] = struct.unpack("<f", f[2])[0]
        events.append(ev)
    return events


def test_crc32c_is_castagnoli():
    assert crc32c_bitwise(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_run_reports_to_tensorboard_while_it_runs(tmp_path, end_server):
    fix = fake_recipe(tmp_path, ["fix", "calc.py", "return a - b", "return a + b"], name="fix")
    res = cli(*base_args(tmp_path, fix, write_tasks(tmp_path, n=2), end_server.url),
              "--report-to", "tensorboard", "--logging-dir", str(tmp_path / "tb"))
    assert res.returncode == 0, res.stderr
    assert f"metrics to TensorBoard in {tmp_path / 'tb'}" in res.stderr
    [path] = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    events = read_events(path)
    assert events[0]["file_version"] == "brain.Event:2"
    steps = [e for e in events if "scalars" in e]
    assert [e["step"] for e in steps] == [1, 2]  # one step per finished episode
    last = steps[-1]["scalars"]
    assert last["rollout/episodes_finished"] == 2 and last["rollout/episodes_done"] == 2
    assert last["rollout/reward_mean"] == 1.0 and last["rollout/reward"] == 1.0
    assert last["rollout/episodes_per_s"] > 0 and last["rollout/call_errors"] == 0
    assert all(e["wall_time"] > 1.6e9 for e in events)
    res = cli(*base_args(tmp_path, fix, write_tasks(tmp_path, n=2), end_server.url), "--report-to", "comet")
    assert res.returncode == 2 and "'comet' is not one of 'none', 'tensorboard', 'wandb'" in res.stderr


# -- W&B ------------------------------------------------------------------------------------------------
# A run file (DIR/wandb/offline-run-*/run-*.wandb) is a LevelDB-style log: a 7-byte header (":W&B",
# a 2-byte magic, a version byte), then records in 32 KiB blocks, each a 7-byte header (CRC 4, length 2
# little-endian, type 1: full / first / middle / last) and its data; a block's tail shorter than a
# header is padding. Each assembled record is one wandb_internal.Record protobuf.
W_BLOCK, W_HEAD = 32 * 1024, 7


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    i, out, part = W_HEAD, [], b""
    while i + W_HEAD <= len(data):
        left = W_BLOCK - i % W_BLOCK
        if left < W_HEAD:  # padding to the next block
            i += left
            continue
        (n,), kind = struct.unpack("<H", data[i + 4:i + 6]), data[i + 6]
        if kind == 0 and n == 0:  # zero fill (preallocated tail)
            break
        part += data[i + W_HEAD:i + W_HEAD + n]
        i += W_HEAD + n
        if kind in (1, 4):  # full, last
            r = pb.Record()
            r.ParseFromString(part)
            out.append(r)
            part = b""
    return out


def test_run_reports_to_wandb_while_it_runs(tmp_path, end_server):
    """--report-to wandb: one W&B step per finished episode with the TensorBoard writer's scalars, in
    offline mode (no W&B server here); the run's config names no secret."""
    import json
    import os

    fix = fake_recipe(tmp_path, ["fix", "calc.py", "return a - b", "return a + b"], name="fix")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_PROJECT": "polar-test", "WANDB_SILENT": "true"}
    res = cli(*base_args(tmp_path, fix, write_tasks(tmp_path, n=2), end_server.url),
              "--report-to", "wandb", "--logging-dir", str(tmp_path / "wb"), env=env)
    assert res.returncode == 0, res.stderr
    assert "polar-rollout: metrics to W&B run" in res.stderr and str(tmp_path / "wb" / "wandb") in res.stderr
    [path] = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    records = wandb_records(path)
    kinds = [r.WhichOneof("record_type") for r in records]
    assert "run" in kinds and "exit" in kinds, kinds  # started and finished
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "polar-test" and run.job_type == "rollout"
    config = {c.key: json.loads(c.value_json) for c in run.config.update}
    assert config["recipe"] == "fix" and config["samples"] == 1 and "secret" not in json.dumps(config), config
    steps = [{(h.key or "/".join(h.nested_key)): json.loads(h.value_json) for h in r.history.item}
             for r in records if r.WhichOneof("record_type") == "history"]
    assert [s["_step"] for s in steps] == [1, 2], steps  # one step per finished episode
    last = steps[-1]
    assert last["rollout/episodes_finished"] == 2 and last["rollout/episodes_done"] == 2
    assert last["rollout/reward_mean"] == 1.0 and last["rollout/call_errors"] == 0


def test_wandb_not_installed_is_a_clear_error_before_any_episode(tmp_path, monkeypatch):
    import sys

    import pytest

    from harness_recipes.node.wandb_run import MetricsBackendError, WandbWriter
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(MetricsBackendError, match="needs the wandb package: pip install wandb"):
        WandbWriter(tmp_path / "wb")


def test_call_numbers_from_the_capture_log(tmp_path):
    L.episode(tmp_path, "ok-1", L.two_tool_turns, reward=1.0)
    L.episode(tmp_path, "open-1", L.two_tool_turns, end=False)
    table, _ = read_table(tmp_path / "ok-1.arrow")
    calls = table.filter(pc.equal(table["kind"], "call"))
    got = call_numbers(tmp_path / "ok-1.arrow")
    assert got["calls"] == calls.num_rows > 0 and got["errors"] == 0
    starts, ends = calls["t_start"].to_pylist(), calls["t_end"].to_pylist()
    assert abs(got["call_s"] - sum(e - s for s, e in zip(starts, ends)) / len(starts)) < 1e-9
    assert call_numbers(tmp_path / "open-1.arrow")["calls"] > 0  # an episode still open counts its calls
    assert call_numbers(tmp_path / "missing.arrow") == {}
