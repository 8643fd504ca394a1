"""``verl.utils.tensordict_utils.get_tensordict`` on ``DataProto.to_tensordict``: the same layout
(tensors as tensors, list/array columns as NonTensorStack, metadata as NonTensorData)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import numpy as np
import torch
from tensordict import TensorDict

from megatron_rl.compat.verl.protocol import DataProto

__all__ = ["get_tensordict"]


def get_tensordict(
    tensor_dict: Mapping[str, torch.Tensor | list | np.ndarray],
    non_tensor_dict: Optional[Mapping[str, Any]] = None,
) -> TensorDict:
    """Columns of ``tensor_dict`` (tensors, or lists / numpy arrays of per-row objects) with the
    entries of ``non_tensor_dict`` as metadata; columns of different lengths are refused by name."""
    tensors, others = {}, {}
    for key, value in tensor_dict.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, (list, np.ndarray)):
            if any(isinstance(item, torch.Tensor) for item in value):
                raise ValueError(
                    f"get_tensordict: column {key!r} is a list holding tensors; pass a tensor or numpy data"
                )
            others[key] = value
        else:
            raise ValueError(
                f"get_tensordict: column {key!r} is a {type(value).__name__}, not a tensor, list or array"
            )
    return DataProto.from_dict(tensors, others, non_tensor_dict).to_tensordict()
