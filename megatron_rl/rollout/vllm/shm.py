"""Weights to vLLM's worker processes through POSIX shared memory (the CPU path of a weight sync).

A tensor in ``LLM.collective_rpc``'s arguments reaches a multiprocess worker msgpack-encoded as nested lists,
so weights travel by handle: the sender copies a bucket into a /dev/shm segment (one memcpy of its used bytes)
and sends only the segment's layout (plain names and numbers). A worker maps the segment copy-on-write with
``torch.from_file``, not ``multiprocessing.shared_memory``, whose resource tracker would unlink the sender's
segment when the worker exits. The sender unlinks a segment once the RPC that read it has returned. A layout
may list only some of its segment's tensors (the others load in a later RPC).

A full tmpfs accepts a sparse ``ftruncate`` and kills the writer with SIGBUS at the page fault that finds no
page. So a segment is checked against the directory's free space before anything is written (an error naming
the directory, its size, its free bytes and the need), and its pages are reserved with ``posix_fallocate``
before the copy, which fails (ENOSPC) instead of faulting when another process took the space meanwhile.

Segments go to /dev/shm, or to ``$MEGATRON_RL_SHM_DIR`` (read in ``staging_dir`` only; a tmpfs of its own).
This module is imported inside vLLM's workers too: torch and the standard library only.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SHM_DIR_ENV", "ShmSegment", "ShmSpaceError", "map_layout", "new_segment_name", "staging_dir"]

SHM_DIR_ENV = "MEGATRON_RL_SHM_DIR"
BUCKET_KEY = "actor_rollout_ref.rollout.weight_sync.bucket_size_mb"
_counter = itertools.count()


class ShmSpaceError(RuntimeError):
    """The shared-memory directory cannot hold a segment; raised before anything is written."""


def staging_dir() -> str:
    """Where this process writes segments: /dev/shm unless ``$MEGATRON_RL_SHM_DIR`` names another tmpfs."""
    return os.environ.get(SHM_DIR_ENV) or "/dev/shm"


def new_segment_name(tag: str) -> str:
    """A segment name unique on this host: process id, a per-process counter, and what it holds."""
    return f"mrl_vllm_{os.getpid()}_{next(_counter)}_{tag}"


def _check_free_space(directory: str, nbytes: int) -> None:
    stat = os.statvfs(directory)
    free, size = stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize
    if nbytes > free:
        raise ShmSpaceError(
            f"{directory} cannot hold a weight segment of {nbytes} bytes: it has {free} bytes free of {size} "
            f"(weights reach vLLM's CPU workers through it, one bucket per segment); lower {BUCKET_KEY} or give "
            f"the host more shared memory (e.g. docker --shm-size)")


class ShmSegment:
    """One file in ``directory`` holding tensors back to back; ``layout`` describes them for ``map_layout``."""

    def __init__(self, directory: str, name: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.path = os.path.join(directory, name)
        entries, size = [], 0
        for tensor_name, tensor in tensors:
            itemsize = tensor.element_size()
            start = (size + itemsize - 1) // itemsize * itemsize
            size = start + tensor.numel() * itemsize
            entries.append([tensor_name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), start, size])
        self.layout: dict[str, Any] = {"path": self.path, "size": max(size, 1), "tensors": entries}
        _check_free_space(directory, self.layout["size"])
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, self.layout["size"])  # every page now, or ENOSPC: never SIGBUS later
            except OSError as exc:
                raise ShmSpaceError(f"{directory} ran out of space reserving a weight segment of "
                                    f"{self.layout['size']} bytes ({exc}); lower {BUCKET_KEY}") from exc
            finally:
                os.close(fd)
            raw = torch.from_file(self.path, shared=True, size=self.layout["size"], dtype=torch.uint8)
            for (_, _, _, start, end), (_, tensor) in zip(entries, tensors):
                raw[start:end].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            del raw
        except BaseException:
            self.unlink()
            raise

    @property
    def nbytes(self) -> int:
        return self.layout["size"]

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def map_layout(layout: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The layout's tensors as views of a private (copy-on-write) mapping: no copy until the loader copies."""
    raw = torch.from_file(layout["path"], shared=False, size=int(layout["size"]), dtype=torch.uint8)
    for name, dtype, shape, start, end in layout["tensors"]:
        yield name, raw[start:end].view(getattr(torch, dtype)).view(shape)
