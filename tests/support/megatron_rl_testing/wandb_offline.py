"""What an offline W&B run (WANDB_MODE=offline) recorded: its run record and the history rows, read back from the
``run-<id>.wandb`` file with wandb's own protobuf messages. wandb 0.30 keeps no Python reader of that file (its
core, in Go, writes it), so the framing is read here: LevelDB's log format, a 7-byte ``:W&B`` header, then 32 KiB
blocks of chunks (crc32 u32, length u16, kind u8: 1 whole, 2 first, 3 middle, 4 last)."""
from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# `make install` puts wandb here, beside the venv and off its path: Megatron-Core imports wandb at import when it can
# (inference/contexts/dynamic_context.py), seconds for every rank process of the suite.
WANDB_SITE = Path(sys.prefix) / "wandb-site"

BLOCK = 32 * 1024
CHUNK_HEADER = 7
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class OfflineRun:
    project: str
    name: str
    history: list[dict[str, object]]  # one row per logged step, values decoded from their JSON


def use_wandb(monkeypatch) -> None:
    """wandb importable in this process and the processes it starts (PYTHONPATH), offline, quiet; refused with the
    command that installs it when it is not there."""
    if not (WANDB_SITE / "wandb").is_dir():
        raise AssertionError(f"wandb is not installed in {WANDB_SITE}: run `make install` (the Makefile puts it there)")
    monkeypatch.syspath_prepend(str(WANDB_SITE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(WANDB_SITE), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def _chunks(raw: bytes) -> Iterator[bytes]:
    if raw[:4] != b":W&B":
        raise ValueError(f"not a W&B run file: it starts with {raw[:7]!r}")
    pos, pending = CHUNK_HEADER, b""
    while pos + CHUNK_HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + CHUNK_HEADER])
        data = raw[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        pos += CHUNK_HEADER + length
        if kind == WHOLE:
            yield data
        elif kind == FIRST:
            pending = data
        elif kind == MIDDLE:
            pending += data
        elif kind == LAST:
            yield pending + data
            pending = b""
        elif length == 0:  # zero fill at the end of the last block
            return


def read_offline_run(wandb_dir: Path) -> OfflineRun:
    """The one offline run under ``wandb_dir`` (WANDB_DIR): refused when there is none or several."""
    files = sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if len(files) != 1:
        raise AssertionError(f"expected one offline run under {wandb_dir}/wandb, found {[str(f) for f in files]}")
    from wandb.proto import wandb_internal_pb2  # on the path only after use_wandb()

    project = name = ""
    history = []
    for data in _chunks(files[0].read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":  # the first run record names the run; later ones (updates) may leave fields empty
            project, name = project or record.run.project, name or record.run.display_name
        elif kind == "history":
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in record.history.item})
    return OfflineRun(project, name, history)
