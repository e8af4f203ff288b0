"""Read an offline W&B run (``run-*.wandb``) back, so tests can check what was logged.

The file is a LevelDB-style log: a 7-byte header (":W&B", magic, version), then 32 KiB blocks
of records, each with a 7-byte header (crc32, length, type: full/first/middle/last) and a
chunk of a serialised ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every protobuf record of the run, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:HEADER])
    assert ident == b":W&B", ident
    out, pos, parts = [], HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and length == 0:
            pos += left  # zero padding
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (FULL, FIRST):
            parts = [chunk]
        else:
            parts.append(chunk)
        if kind in (FULL, LAST):
            r = pb.Record()
            r.ParseFromString(b"".join(parts))
            out.append(r)
    return out


def run_contents(run_dir: Path, every: bool = False) -> Any:
    """The offline W&B run under ``run_dir/wandb``: ``{"config": {key: value}, "history":
    [{key: value}], "group", "name", "tags"}`` (values decoded from their JSON). A resumed run
    has one offline log per process: ``every=True`` returns them all, oldest first."""
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if every:
        assert files, run_dir
        return [_contents(f) for f in files]
    assert len(files) == 1, files
    return _contents(files[0])


def _contents(path: Path) -> dict[str, Any]:
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    info: dict[str, Any] = {"group": None, "name": None, "tags": []}  # empty when killed before W&B flushed
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            info = {"group": r.run.run_group, "name": r.run.display_name, "tags": list(r.run.tags)}
            for u in r.run.config.update:
                config[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
        elif kind == "config":
            for u in r.config.update:
                config[u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
        elif kind == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item})
    return {"config": config, "history": history, **info}
