"""Map verl's per-response ``uid`` array to dense group ids, the form the group ops take."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def group_ids_from_uids(
    index: np.ndarray | Sequence | torch.Tensor, batch_size: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, int]:
    """uids (strings or ints, one per response) -> (int64 group ids in [0, G) on ``device``, G).

    Responses sharing a uid (the n samples of one prompt) share a group id. ``np.unique`` sorts the
    uids once, so the cost does not grow with the number of groups.
    """
    arr = index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
    if arr.ndim != 1 or arr.shape[0] != batch_size:
        raise ValueError(
            f"index (the uid array) has shape {arr.shape}, expected ({batch_size},): one uid per response row"
        )
    try:
        uniques, inverse = np.unique(arr, return_inverse=True)
    except TypeError as err:
        kinds = sorted({type(u).__name__ for u in arr.tolist()})
        raise TypeError(
            f"index (the uid array) must hold uids of one comparable kind, got types {kinds}"
        ) from err
    groups = torch.from_numpy(inverse.reshape(-1).astype(np.int64)).to(device)
    return groups, len(uniques)
