"""Random batches shaped like the trainer's: right-padded masks, outcome rewards, grouped uids."""

from __future__ import annotations

import numpy as np
import torch


def random_mask(
    batch: int, length: int, gen: torch.Generator, *, empty_rows: tuple[int, ...] = ()
) -> torch.Tensor:
    """Right-padded response masks with random lengths in [1, length]; ``empty_rows`` get length 0."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[list(empty_rows)] = 0
    return (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()


def outcome_rewards(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A scalar score on the last valid token of each response (none on an empty response)."""
    rewards = torch.zeros_like(mask)
    lengths = mask.sum(dim=-1).long()
    rows = torch.nonzero(lengths > 0).flatten()
    rewards[rows, lengths[rows] - 1] = scores[rows].to(rewards.dtype)
    return rewards


def grouped_uids(group_sizes: list[int], as_str: bool = True) -> np.ndarray:
    """uids laid out as DataProto.repeat(interleave=True) makes them, for groups of the given sizes."""
    uids = [
        f"prompt-{g}" if as_str else 1000 + 7 * g for g, size in enumerate(group_sizes) for _ in range(size)
    ]
    return np.array(uids, dtype=object)
