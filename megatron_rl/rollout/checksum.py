"""Per-tensor checksums computed on both ends of a weight sync, to name the tensor that went wrong.

A checksum is three fp64 moments of the tensor's values — sum, sum of squares and a position-weighted
sum (weights cycle through 1..1021, so swapped rows or a wrong reshape change it, which plain moments
would miss). They are cheap on GPU (memory-bound, chunked so a 1 GB embedding needs no 8 GB fp64 copy)
and comparable across devices: the two sides may sum in different orders, so the comparison allows a
relative error of 1e-9 of the tensor's scale, far below any real corruption.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

__all__ = ["TensorChecksum", "mismatched_tensors", "tensor_checksum"]

_PERIOD = 1021  # prime: positions i and j get different weights unless i = j (mod 1021)
_CHUNK = _PERIOD * 16384  # ~16.7M elements per fp64 chunk; a multiple of the period keeps weights aligned
_RTOL = 1e-9


@dataclass(frozen=True)
class TensorChecksum:
    shape: tuple[int, ...]
    dtype: str
    total: float
    total_sq: float
    weighted: float

    def matches(self, other: TensorChecksum) -> bool:
        if self.shape != other.shape or self.dtype != other.dtype:
            return False
        numel = math.prod(self.shape)
        # |sum| and |weighted| are bounded by sqrt(n * sum_sq) (and _PERIOD times that), so this scale
        # is a tolerance that cannot hide a changed value yet absorbs fp64 reordering noise.
        scale = math.sqrt(max(numel, 1) * max(self.total_sq, other.total_sq)) + 1e-30
        return (
            abs(self.total - other.total) <= _RTOL * scale
            and abs(self.total_sq - other.total_sq) <= _RTOL * (max(self.total_sq, other.total_sq) + 1e-30)
            and abs(self.weighted - other.weighted) <= _RTOL * _PERIOD * scale
        )


_weights_cache: dict[torch.device, torch.Tensor] = {}


def _position_weights(device: torch.device, numel: int) -> torch.Tensor:
    """Weights for the first ``numel`` (<= _CHUNK) positions, cached per device and grown on demand."""
    cached = _weights_cache.get(device)
    if cached is None or cached.numel() < numel:
        size = min(_CHUNK, max(numel, 2 * (0 if cached is None else cached.numel())))
        cached = _weights_cache[device] = (torch.arange(size, device=device) % _PERIOD + 1).to(torch.float64)
    return cached[:numel]


@torch.no_grad()
def tensor_checksum(tensor: torch.Tensor) -> TensorChecksum:
    flat = tensor.detach().reshape(-1)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    total_sq = torch.zeros_like(total)
    weighted = torch.zeros_like(total)
    weights = _position_weights(flat.device, min(flat.numel(), _CHUNK))
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start : start + _CHUNK].to(torch.float64)
        total += chunk.sum()
        total_sq += chunk.square().sum()
        weighted += (chunk * weights[: chunk.numel()]).sum()
    return TensorChecksum(
        shape=tuple(tensor.shape),
        dtype=str(tensor.dtype).replace("torch.", ""),
        total=float(total),
        total_sq=float(total_sq),
        weighted=float(weighted),
    )


def mismatched_tensors(
    source: Mapping[str, TensorChecksum],
    engine: Mapping[str, TensorChecksum],
    names: Iterable[str] | None = None,
) -> list[str]:
    """Names (in the source's order) whose checksums differ, or that one side lacks."""
    names = list(source) if names is None else list(names)
    return [n for n in names if n not in source or n not in engine or not source[n].matches(engine[n])]
