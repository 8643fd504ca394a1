"""Multimodal RoPE positions (mRoPE) of Qwen-VL language models: a (temporal, height, width) position per token.

A text token's three positions are equal and count up by one per token, as a text model's. An image's tokens (its
merged patch grid, ``t x h x w`` with ``h, w`` the patch grid divided by the spatial merge size) take positions
``start + (t_i, h_i, w_i)``; the text after the image continues from ``start + max(h, w)``. Padding gets 0.
The language model computes this from the token ids and each image's grid (``image_grid_thw``, what the processor
returns), so prompts, responses, rollouts and trainer batches carry only the usual 1-D ids and masks. Qwen2.5-VL and
Qwen3-VL give still images the same positions (their transformers ``get_rope_index``; they differ for videos, which
are not read here); they differ in which rotary frequencies each of the three positions turns: Qwen2.5-VL's in
sections (Megatron-Core's MultimodalRotaryEmbedding), Qwen3-VL's interleaved (``interleaved_mrope_axes``).
"""

from __future__ import annotations

import torch

__all__ = ["interleaved_mrope_axes", "mrope_position_ids"]


def _image_positions(grid: list[int], merge: int, start: int) -> torch.Tensor:
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _row_positions(ids: torch.Tensor, is_image: torch.Tensor, grids: list[list[int]], merge: int,
                   where: str) -> torch.Tensor:
    positions = torch.empty(3, len(ids), dtype=torch.long)
    change = (torch.nonzero(is_image[1:] != is_image[:-1]).flatten() + 1).tolist()
    bounds = [0, *change, len(ids)]
    current = 0
    for a, z in zip(bounds[:-1], bounds[1:]):
        if not is_image[a]:
            positions[:, a:z] = torch.arange(current, current + z - a)
            current += z - a
            continue
        k = a
        while k < z:  # a run may hold several images back to back
            if not grids:
                raise ValueError(f"{where}: more image tokens than image_grid_thw has images")
            grid = grids.pop(0)
            block = _image_positions(grid, merge, current)
            if k + block.shape[1] > z:
                raise ValueError(f"{where}: image of grid {grid} needs {block.shape[1]} image tokens, the "
                                 f"sequence has {z - k} there")
            positions[:, k:k + block.shape[1]] = block
            current += max(grid[1], grid[2]) // merge
            k += block.shape[1]
    return positions


def mrope_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
    image_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[3, B, T] positions of ``input_ids`` [B, T]; ``image_grid_thw`` [num_images, 3] lists the images of all rows
    in order (row 0's first). Tokens where ``attention_mask`` is 0 are skipped and get position 0. ``image_mask``
    [B, T] marks the image tokens (models/vision_inputs.py ``image_token_mask``); default: every ``image_token_id``."""
    batch, length = input_ids.shape
    positions = torch.zeros(3, batch, length, dtype=torch.long)
    grids = image_grid_thw.tolist() if image_grid_thw is not None else []
    ids_cpu = input_ids.cpu()
    mask = attention_mask.bool().cpu() if attention_mask is not None else torch.ones_like(ids_cpu, dtype=torch.bool)
    is_image = (ids_cpu == image_token_id) if image_mask is None else image_mask.bool().cpu()
    for row in range(batch):
        ids = ids_cpu[row][mask[row]]
        if len(ids):
            positions[:, row, mask[row]] = _row_positions(ids, is_image[row][mask[row]], grids, spatial_merge_size,
                                                          f"row {row}")
    if grids:
        raise ValueError(f"image_grid_thw has {len(grids)} more images than the batch has image tokens for")
    return positions.to(input_ids.device)


def interleaved_mrope_axes(mrope_section: tuple[int, int, int] | list[int], pairs: int) -> torch.Tensor:
    """[pairs]: which position (0 temporal, 1 height, 2 width) rotates each rotary frequency pair of a head under
    Qwen3-VL's interleaved mRoPE (``mrope_interleaved``, transformers' ``Qwen3VLTextRotaryEmbedding``): pair ``j``
    takes the height position when ``j % 3 == 1`` and ``j < 3 * section[1]``, the width when ``j % 3 == 2`` and
    ``j < 3 * section[2]``, the temporal one otherwise (Qwen3-VL-8B's [24, 20, 20] of 64 pairs: t, h, w, t, h, w,
    ... for 60 pairs, then 4 temporal). Sectioned mRoPE (Qwen2.5-VL) gives the first section[0] pairs to t, the
    next section[1] to h, the rest to w instead."""
    j = torch.arange(pairs)
    axes = torch.zeros(pairs, dtype=torch.long)
    for axis in (1, 2):
        axes[(j % 3 == axis) & (j < 3 * int(mrope_section[axis]))] = axis
    return axes
