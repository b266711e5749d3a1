"""Read a wandb offline run file (``run-<id>.wandb``) back without wandb's own reader (removed in 0.31).

The file is wandb's LevelDB-style log: a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, version 0),
then 32 KiB blocks of chunks, each with a 7-byte header (crc32c, length uint16 LE, type: 1 full, 2 first,
3 middle, 4 last); a block tail shorter than a chunk header is zero padding. Each whole record is a
serialized ``wandb_internal_pb2.Record``. The crc is not checked: this reads what the test just wrote.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    """Every Record of the file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:7] == HEADER, f"{path}: not a wandb log (header {data[:7]!r})"
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block tail padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # zero padding at the end of the last block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def history(path: Path) -> list[dict]:
    """The logged rows: {key: value} per history record (wandb's own _step etc. included)."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                         for item in rec.history.item})
    return rows


def config(path: Path) -> dict:
    """The run's config as wandb recorded it (the last value of each key)."""
    found = {}
    for rec in records(path):
        if rec.WhichOneof("record_type") == "config":
            for item in rec.config.update:
                found[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif rec.WhichOneof("record_type") == "run":
            for item in rec.run.config.update:
                found[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return found
