"""Read a W&B offline run's `run-<id>.wandb` file back (tests): wandb >= 0.2x no longer ships a Python reader.

The file is W&B's transaction log: a 7-byte header (`:W&B`, magic 0xBEE1, version 0), then LevelDB's log
format in 32 KiB blocks: each record piece has a 7-byte header (CRC-32 of type + data, little-endian length,
type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4), pieces never cross a block, and a block's tail shorter than a
header is zero padding. Each whole record is a serialized `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
"""The first 7 bytes of a .wandb file."""

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> Iterator[bytes]:
    """The serialized records of a .wandb file, in order (a CRC mismatch or a torn record raises ValueError)."""
    data = Path(path).read_bytes()
    if not data.startswith(HEADER):
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding: the file ends (or the writer pre-allocated)
            break
        body = data[pos + 7:pos + 7 + length]
        if len(body) < length or zlib.crc32(bytes([kind]) + body) != checksum:
            raise ValueError(f"{path}: damaged record at byte {pos}")
        pos += 7 + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body
            pending = b""
