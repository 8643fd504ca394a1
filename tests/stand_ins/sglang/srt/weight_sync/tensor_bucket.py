"""Stand-in of ``sglang.srt.weight_sync.tensor_bucket`` (only the metadata record)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FlattenedTensorMetadata"]


@dataclass
class FlattenedTensorMetadata:
    """One tensor's place in a flattened uint8 bucket (same fields as SGLang 0.5.23)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int
