"""A fingerprint of the weights in a model directory, cheap at 70B (issue 56), for the run identity.

Two fine-tunes of one base share ``config.json`` and the tokenizer; only the weights tell them apart, and hashing
140 GB at every start and save is out of the question. Per weight file (``*.safetensors``; ``*.bin`` / ``*.pt`` /
``*.pth`` as plain files) the fingerprint holds its name, its size, the sha256 of its safetensors header (tensor
names, dtypes, shapes, offsets; ``__metadata__`` left out) and the sha256 of a bounded set of its bytes: the first
and the last 4 KiB of every tensor (a whole tensor up to 8 KiB) and 8 samples of 64 KiB at evenly spaced offsets.

A tensor a fine-tune trained (it moves every element) is caught whatever the sampling's positions: every tensor's
first and last bytes are read. Not caught: a change confined to a tensor's interior that misses the 8 samples of
its file (say a few rows in the middle of an embedding and nothing else); in a plain ``.bin`` / ``.pt`` file (no
header to place windows by) anything the 8 samples miss; files in subdirectories.

Cost (2-CPU VM, warm page cache, best of several): the tiny test model (1 file, 27 tensors, 0.3 MiB, all of it
read) 0.6 ms; a sparse 1 GiB file of 256 tensors 4 ms (2.5 MiB read); Llama-3-70B's shapes (723 bf16 tensors,
141 GB in 30 sparse shards) 48 ms, 180 ms the first time (19.8 MiB read in ~1.7k reads). A cold network file
system pays its latency per read on top.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TENSOR_WINDOW = 4 << 10  # each tensor's first and last bytes
FILE_SAMPLE = 64 << 10
FILE_SAMPLES = 8  # evenly spaced over each file's data
MAX_HEADER = 100 << 20  # safetensors' own limit on a header


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header and where its data starts; ValueError naming the file when it is no such file."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if not 0 < length <= MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(handle.read(length))
        except ValueError as err:
            raise ValueError(f"{path}: unreadable safetensors header ({err})") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path}: unreadable safetensors header (a {type(header).__name__}, not an object)")
    return header, 8 + length


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _sampled_ranges(tensors: dict[str, Any], data_start: int, size: int) -> list[tuple[int, int]]:
    """The byte ranges a file's fingerprint reads: each tensor's first and last window, and the file's samples."""
    ranges = []
    for entry in tensors.values():
        begin, end = (data_start + offset for offset in entry["data_offsets"])
        ranges += [(begin, min(end, begin + TENSOR_WINDOW)), (max(begin, end - TENSOR_WINDOW), end)]
    span = max(0, size - data_start - FILE_SAMPLE)
    ranges += [(start, start + FILE_SAMPLE) for start in
               sorted({data_start + span * k // (FILE_SAMPLES - 1) for k in range(FILE_SAMPLES)})]
    return _merged([(start, min(end, size)) for start, end in ranges])


def file_fingerprint(path: Path) -> dict[str, Any]:
    """One weight file: size, header sha256 (safetensors; None for a plain file), sampled bytes' sha256 and count."""
    size = path.stat().st_size
    header_sha, tensors, data_start = None, {}, 0
    if path.suffix == ".safetensors":
        header, data_start = read_header(path)
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        for name, entry in tensors.items():
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
                raise ValueError(f"{path}: tensor {name}: data_offsets {offsets!r} (two byte offsets expected)")
        header_sha = hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()
    digest, sampled = hashlib.sha256(), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for start, end in _sampled_ranges(tensors, data_start, size):
            chunk = os.pread(fd, end - start, start)
            digest.update(start.to_bytes(8, "little") + chunk)
            sampled += len(chunk)
    finally:
        os.close(fd)
    return {"size": size, "header_sha256": header_sha, "sampled_sha256": digest.hexdigest(), "sampled_bytes": sampled}


def weights_fingerprint(model_dir: Path) -> dict[str, Any] | None:
    """``{"sha256": ..., "files": {name: file_fingerprint}}`` of the weight files directly in ``model_dir``; None
    where it holds none (a hub name, a directory without weights). The path and times are not part of it: the same
    bytes elsewhere give the same fingerprint."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    names = sorted(p.name for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not names:
        return None
    files = {name: file_fingerprint(model_dir / name) for name in names}
    overall = hashlib.sha256(json.dumps({name: {k: v for k, v in entry.items() if k != "sampled_bytes"}
                                         for name, entry in files.items()}, sort_keys=True).encode())
    return {"sha256": overall.hexdigest(), "files": files}


def fingerprint_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs, file by file, between two fingerprints ([] for the same weights)."""
    before, after = saved.get("files") or {}, now.get("files") or {}
    problems = []
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or new is None:
            problems.append(f"{name}: only in the {'checkpoint' if new is None else 'new'} model directory")
        elif old["size"] != new["size"]:
            problems.append(f"{name}: {old['size']} -> {new['size']} bytes")
        elif old["header_sha256"] != new["header_sha256"]:
            problems.append(f"{name}: other header (tensor names, dtypes, shapes or offsets)")
        elif old["sampled_sha256"] != new["sampled_sha256"]:
            problems.append(f"{name}: other tensor data (same header)")
    return problems
