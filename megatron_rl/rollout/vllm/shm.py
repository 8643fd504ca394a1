"""Weights to vLLM's worker processes through POSIX shared memory (the CPU path of a weight sync).

A tensor in ``LLM.collective_rpc``'s arguments reaches a multiprocess worker msgpack-encoded as nested lists,
so weights travel by handle: the sender copies a bucket into a /dev/shm segment (one memcpy of its used bytes)
and sends only the segment's layout (plain names and numbers). A worker maps the segment copy-on-write with
``torch.from_file``, not ``multiprocessing.shared_memory``, whose resource tracker would unlink the sender's
segment when the worker exits. The sender unlinks a segment once the RPC that read it has returned.

This module is imported inside vLLM's workers too: torch and the standard library only.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["ShmSegment", "map_layout", "new_segment_name"]

SHM_DIR = "/dev/shm"
_counter = itertools.count()


def new_segment_name(tag: str) -> str:
    """A segment name unique on this host: process id, a per-process counter, and what it holds."""
    return f"mrl_vllm_{os.getpid()}_{next(_counter)}_{tag}"


class ShmSegment:
    """One /dev/shm file holding tensors back to back; ``layout`` describes them for ``map_layout``."""

    def __init__(self, name: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.path = os.path.join(SHM_DIR, name)
        entries, size = [], 0
        for tensor_name, tensor in tensors:
            itemsize = tensor.element_size()
            start = (size + itemsize - 1) // itemsize * itemsize
            size = start + tensor.numel() * itemsize
            entries.append([tensor_name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), start, size])
        self.layout: dict[str, Any] = {"path": self.path, "size": max(size, 1), "tensors": entries}
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.layout["size"])
        finally:
            os.close(fd)
        try:
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
    """The segment's tensors as views of a private (copy-on-write) mapping: no copy until the loader copies."""
    raw = torch.from_file(layout["path"], shared=False, size=int(layout["size"]), dtype=torch.uint8)
    for name, dtype, shape, start, end in layout["tensors"]:
        yield name, raw[start:end].view(getattr(torch, dtype)).view(shape)
