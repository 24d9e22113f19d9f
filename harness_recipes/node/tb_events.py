"""TensorBoard event files, written without TensorBoard: scalars a running rollout reports.

The format TensorBoard reads (and ``torch.utils.tensorboard.SummaryWriter`` writes): a file named
``events.out.tfevents.<unix time>.<host>.<pid>.<suffix>`` of TFRecords, each

    uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)

(little-endian; masked = ((crc >> 15 | crc << 17) + 0xa282ead8) mod 2**32), whose data is one
``tensorflow.Event`` protobuf: ``wall_time`` (field 1, double), ``step`` (2, int64), then
``file_version`` (3, string, the first record: "brain.Event:2") or ``summary`` (5: a ``Summary``
of ``value`` (1) messages, each ``tag`` (1, string) and ``simple_value`` (2, float)). The
protobuf is written by hand here (a handful of fields), so polar-rollout needs neither
tensorboard nor protobuf to report to TensorBoard; `tensorboard --logdir DIR` reads the files.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One TFRecord around ``data``."""
    head = struct.pack("<Q", len(data))
    return head + struct.pack("<I", masked_crc32c(head)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # (int64 as protobuf encodes negatives: ten bytes)
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def event(wall_time: float, step: int = 0, *, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """One serialized Event: a file-version header or a summary of scalars."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", float(v))))
                          for tag, v in scalars.items())
        out += _bytes_field(5, values)
    return out


class EventWriter:
    """Appends scalar events to one new event file under ``logdir`` (created); each write is flushed,
    so TensorBoard shows a running job's values as they come."""

    def __init__(self, logdir: str | os.PathLike, suffix: str = "polar-rollout"):
        self.dir = Path(logdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.dir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.{suffix}"
        self._f = open(self.path, "ab")  # noqa: SIM115 - kept open for the run, closed by close()
        self._f.write(record(event(now, file_version="brain.Event:2")))
        self._f.flush()

    def scalars(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        self._f.write(record(event(time.time() if wall_time is None else wall_time, step, scalars=values)))
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()
