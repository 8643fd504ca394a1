"""A flat byte buffer holding many named tensors: the unit a weight sync pushes to an engine.

It is to a weight what ``DataProto`` is to a sample: the Megatron export fills it, weight sync hands it to
engines, servers and checkpoints. The layout is SGLang's ``flattened_bucket`` (one 1-D uint8 tensor plus, per tensor, name, shape, dtype
and the byte range ``[start, end)``), so the SGLang engine sends a bucket as is and the HF engine reads
views of it. Each entry starts at the first offset aligned to its dtype's size, so a single-dtype bucket
is packed back to back — the layout SGLang's distributed receiver allocates from (names, dtypes, shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "BucketEntry", "WeightBucket"]

DEFAULT_BUCKET_BYTES = 512 << 20  # full-tensor bytes per bucket: rollout.weight_sync.bucket_size_mb's default


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int  # byte offsets into the bucket's buffer
    end: int

    @property
    def numel(self) -> int:
        return (self.end - self.start) // self.dtype.itemsize


class WeightBucket:
    """Fill with ``add`` (casting into the buffer in one copy), read with ``named_tensors``, reuse after
    ``clear``. The bucket owns its buffer; views returned by ``named_tensors`` die with the next ``add``."""

    def __init__(self, capacity_bytes: int, device: torch.device | str) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"bucket capacity must be positive, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.device = torch.device(device)
        self.buffer: torch.Tensor | None = None  # allocated on first use
        self.entries: list[BucketEntry] = []
        self.used = 0
        # Sealed: filled once by its producer and never written again (the weight export makes a fresh one per
        # bucket), so a consumer may hand it to an engine as is, even an asynchronous one, instead of copying.
        self.sealed = False

    @classmethod
    def wrapping(cls, name: str, tensor: torch.Tensor) -> WeightBucket:
        """A single-tensor bucket over the tensor's own bytes (for tensors larger than any bucket)."""
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        bucket = cls(max(flat.numel(), 1), tensor.device)
        bucket.buffer = flat
        bucket.entries = [BucketEntry(name, tuple(tensor.shape), tensor.dtype, 0, flat.numel())]
        bucket.used = flat.numel()
        return bucket

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (padding excluded)."""
        return sum(e.end - e.start for e in self.entries)

    def fits(self, nbytes: int, dtype: torch.dtype) -> bool:
        return _aligned(self.used, dtype.itemsize) + nbytes <= self.capacity

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        """Copy ``tensor`` into the buffer as ``dtype`` (the cast and the copy are one kernel)."""
        self._check_writable()
        nbytes = tensor.numel() * dtype.itemsize
        if not self.fits(nbytes, dtype):
            raise ValueError(
                f"tensor {name!r} ({nbytes} bytes) does not fit: {self.used}/{self.capacity} bytes used"
            )
        if self.buffer is None:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        start = _aligned(self.used, dtype.itemsize)
        end = start + nbytes
        self.buffer[start:end].view(dtype).view(tensor.shape).copy_(tensor.detach())
        self.entries.append(BucketEntry(name, tuple(tensor.shape), dtype, start, end))
        self.used = end

    def reserve(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Append an entry and return its (uninitialised) view: the caller writes the tensor in place."""
        self._check_writable()
        nbytes = _numel(shape) * dtype.itemsize
        if not self.fits(nbytes, dtype):
            raise ValueError(f"tensor {name!r} ({nbytes} bytes) does not fit: {self.used}/{self.capacity} bytes used")
        if self.buffer is None:
            self.buffer = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        start = _aligned(self.used, dtype.itemsize)
        self.entries.append(BucketEntry(name, tuple(shape), dtype, start, start + nbytes))
        self.used = start + nbytes
        return self.tensor(-1)

    @staticmethod
    def capacity_for(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        """Bytes a bucket needs to hold tensors of these (shape, dtype), in this order, aligned."""
        used = 0
        for shape, dtype in specs:
            used = _aligned(used, dtype.itemsize) + _numel(shape) * dtype.itemsize
        return max(used, 1)

    def flat(self) -> torch.Tensor:
        """The used part of the buffer, 1-D uint8 (what SGLang calls ``flattened_tensor``)."""
        assert self.buffer is not None, "empty bucket"
        return self.buffer[: self.used]

    def tensor(self, index: int) -> torch.Tensor:
        """A view of entry ``index`` in its dtype and shape."""
        entry = self.entries[index]
        return self.buffer[entry.start : entry.end].view(entry.dtype).view(entry.shape)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(entry.name, self.tensor(i)) for i, entry in enumerate(self.entries)]

    def clear(self) -> None:
        self._check_writable()
        self.entries = []
        self.used = 0

    def _check_writable(self) -> None:
        if self.sealed:
            raise ValueError("a sealed bucket is never written again: its producer has handed it on")

    def seal(self) -> WeightBucket:
        """Declare the bucket immutable from now on (its producer will never write it again)."""
        self.sealed = True
        return self

    def adopt(self) -> bool:
        """Take a sealed bucket's memory over instead of copying out of it (an in-process engine makes its
        parameters views of it). True once: the bucket is unsealed, so it is nobody's shared immutable buffer
        any more (its new owner may write it) and a second engine handed the same bucket copies."""
        if not self.sealed or self.buffer is None:
            return False
        self.sealed = False
        return True


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _aligned(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment
