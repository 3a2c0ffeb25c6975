"""Read W&B's offline run files back: the history rows a run logged, as W&B stored them.

A ``run-<id>.wandb`` file is a LevelDB-style log (a 7-byte ``:W&B`` header, then 32 KiB
blocks of chunks with a 7-byte header: crc32, length, type) of ``wandb_internal_pb2.Record``
protobufs; the ``wandb`` package has no public reader for it, so this small one parses it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every record of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    out, pos, pending = [], HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # the block's tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def history(run_dir: Path) -> list[tuple[int, dict[str, Any]]]:
    """(W&B step, row) of every history row of every offline run under ``run_dir/wandb``,
    the runs in the order they started."""
    rows = []
    for run in sorted((run_dir / "wandb").glob("offline-run-*")):
        for file in run.glob("run-*.wandb"):
            for record in records(file):
                if record.WhichOneof("record_type") == "history":
                    row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                    rows.append((record.history.step.num, row))
    return rows
