"""sha256 of a checkpoint's files for its manifest (trainer/checkpointing.py): the files the driver reads back and
the metadata, and with ``trainer.checkpoint_hash_shards`` the tensor shards (``*.distcp``, the bulk), so a byte
changed inside a shard is refused at resume like any other file.

Files are hashed in threads (hashlib releases the GIL while it hashes a block, so a checkpoint of many shards is
read at the disk's speed rather than one core's). A file whose path, inode, size and modification time did not
change is hashed once per process (preflight and the resume itself verify the same checkpoint), unless it was
modified in the last seconds: a rewrite within the file system's timestamp granularity keeps the modification
time (git's "racy" files), so a recent file is always read again.
"""
from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

_BLOCK = 1 << 20
_THREADS = min(8, os.cpu_count() or 1)
_RACY_NS = 2_000_000_000  # files modified more recently than this are not taken from the cache


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


@lru_cache(maxsize=4096)
def _sha256_of_version(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """Keyed by what changes when the file is rewritten: the arguments besides ``path`` only key the cache."""
    return _sha256(path)


def sha256_of(path: Path) -> str:
    stat = path.stat()
    if time.time_ns() - stat.st_mtime_ns < _RACY_NS:
        return _sha256(str(path))
    return _sha256_of_version(str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)


def sha256_of_files(directory: Path, names: list[str]) -> dict[str, str]:
    """{name: sha256 of ``directory / name``} for every name, hashed in parallel."""
    with ThreadPoolExecutor(max_workers=_THREADS) as pool:
        return dict(zip(names, pool.map(lambda name: sha256_of(directory / name), names), strict=True))
