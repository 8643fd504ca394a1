"""Where a sample's scalar score goes in the [B, R] token-level tensor: its last valid response token.

Prompts are left-padded and responses right-padded (verl's convention); ``response_mask`` marks the
response tokens that count. With multi-turn masks (tool output masked out in the middle) the last
valid token is still the last position whose mask is 1.
"""

from __future__ import annotations

import torch

__all__ = ["last_valid_positions", "place_scores"]


def last_valid_positions(response_mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last position with mask 1 in each row; -1 for a row with none."""
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    return (
        torch.where(response_mask.bool(), positions, -1).amax(dim=1)
        if response_mask.shape[1]
        else torch.full((response_mask.shape[0],), -1, dtype=torch.long, device=response_mask.device)
    )


def place_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[B, R] float32 zeros with ``scores[i]`` at row i's last valid position (0 for an empty row)."""
    if scores.shape != response_mask.shape[:1] or response_mask.dim() != 2:
        raise ValueError(
            f"place_scores: scores {tuple(scores.shape)} must be [B] for response_mask "
            f"{tuple(response_mask.shape)} [B, R]"
        )
    out = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    if response_mask.shape[1]:
        rows = torch.arange(len(scores), device=response_mask.device)
        out[rows, last_valid_positions(response_mask).clamp(min=0)] = scores.to(out)
    return out
