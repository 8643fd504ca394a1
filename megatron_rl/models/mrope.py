"""Multimodal RoPE positions (mRoPE) of Qwen-VL language models: a (temporal, height, width) position per token.

A text token's three positions are equal and count up by one per token, as a text model's. An image's tokens (its
merged patch grid, ``t x h x w`` with ``h, w`` the patch grid divided by the spatial merge size) take positions
``start + (t_i * scale, h_i, w_i)``; the text after it continues from the block's largest position plus one (verl's
and vLLM's ``get_rope_index``; transformers 5.19 continues from ``start + max(h, w)`` instead, the same for images
and for videos whose temporal positions stay below that). Padding gets 0.

Videos: Qwen2.5-VL spaces a video's temporal patches by ``scale = tokens_per_second * second_per_grid_t`` (the
processor's ``second_per_grid_ts``: seconds per temporal patch); Qwen3-VL puts each temporal patch of a video in
its own block, ``<t seconds><|vision_start|>`` frame ``<|vision_end|>`` (``video_frames_apart``), each placed as an
image. The language model computes all this from the token ids and the grids (``image_grid_thw`` /
``video_grid_thw``, what the processor returns), so prompts, responses, rollouts and trainer batches carry only the
usual 1-D ids and masks. The two families differ in which rotary frequencies each of the three positions turns:
Qwen2.5-VL's in sections (Megatron-Core's MultimodalRotaryEmbedding), Qwen3-VL's interleaved
(``interleaved_mrope_axes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["interleaved_mrope_axes", "mrope_position_ids"]

_TEXT, _IMAGE, _VIDEO = 0, 1, 2


@dataclass(frozen=True)
class _Block:
    """One image, one video, or (Qwen3-VL) one temporal patch of a video: its grid and temporal step."""

    grid: tuple[int, int, int]
    scale: float = 1.0

    def positions(self, merge: int, start: int) -> torch.Tensor:
        t, h, w = self.grid[0], self.grid[1] // merge, self.grid[2] // merge
        # float32 as verl's and transformers' get_rope_index multiply
        steps = (torch.arange(t) * torch.tensor(self.scale, dtype=torch.float32)).long()
        tt, hh, ww = torch.meshgrid(steps, torch.arange(h), torch.arange(w),
                                    indexing="ij")
        return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _video_blocks(video_grid_thw: torch.Tensor | None, scales: Sequence[float] | None,
                  frames_apart: bool) -> list[_Block]:
    grids = video_grid_thw.tolist() if video_grid_thw is not None else []
    if scales is not None and len(scales) != len(grids):
        raise ValueError(f"{len(scales)} video time scales (second_per_grid_ts) for {len(grids)} videos "
                         "(video_grid_thw)")
    scales = list(scales) if scales is not None else [1.0] * len(grids)
    if frames_apart:
        return [_Block((1, h, w)) for t, h, w in grids for _ in range(t)]
    return [_Block(tuple(g), float(s)) for g, s in zip(grids, scales)]


def _row_positions(kinds: torch.Tensor, queues: dict[int, list[_Block]], merge: int, where: str) -> torch.Tensor:
    positions = torch.empty(3, len(kinds), dtype=torch.long)
    change = (torch.nonzero(kinds[1:] != kinds[:-1]).flatten() + 1).tolist()
    bounds = [0, *change, len(kinds)]
    current = 0
    for a, z in zip(bounds[:-1], bounds[1:]):
        kind = int(kinds[a])
        if kind == _TEXT:
            positions[:, a:z] = torch.arange(current, current + z - a)
            current += z - a
            continue
        name = "image" if kind == _IMAGE else "video"
        k = a
        while k < z:  # a run may hold several images (videos) back to back
            if not queues[kind]:
                raise ValueError(f"{where}: more {name} tokens than {name}_grid_thw has {name}s for")
            block = queues[kind].pop(0)
            placed = block.positions(merge, current)
            if k + placed.shape[1] > z:
                raise ValueError(f"{where}: {name} of grid {list(block.grid)} needs {placed.shape[1]} {name} tokens, "
                                 f"the sequence has {z - k} there")
            positions[:, k:k + placed.shape[1]] = placed
            current = int(placed.max()) + 1
            k += placed.shape[1]
    return positions


def mrope_position_ids(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
    image_mask: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    video_mask: torch.Tensor | None = None,
    video_time_scales: Sequence[float] | None = None,
    video_frames_apart: bool = False,
) -> torch.Tensor:
    """[3, B, T] positions of ``input_ids`` [B, T]; ``image_grid_thw`` [num_images, 3] lists the images of all rows
    in order (row 0's first), ``video_grid_thw`` [num_videos, 3] their videos. Tokens where ``attention_mask`` is 0
    are skipped and get position 0. ``image_mask`` / ``video_mask`` [B, T] mark the placeholders
    (models/vision_inputs.py ``placeholder_mask``); default: every ``image_token_id``, no video.
    ``video_time_scales``: per video, the temporal position step per temporal patch (Qwen2.5-VL's
    ``tokens_per_second * second_per_grid_ts``; default 1). ``video_frames_apart``: Qwen3-VL's one block per temporal
    patch."""
    batch, length = input_ids.shape
    positions = torch.zeros(3, batch, length, dtype=torch.long)
    ids_cpu = input_ids.cpu()
    mask = attention_mask.bool().cpu() if attention_mask is not None else torch.ones_like(ids_cpu, dtype=torch.bool)
    kinds = torch.zeros_like(ids_cpu)
    kinds[(ids_cpu == image_token_id) if image_mask is None else image_mask.bool().cpu()] = _IMAGE
    if video_mask is not None:
        kinds[video_mask.bool().cpu()] = _VIDEO
    queues = {
        _IMAGE: [_Block(tuple(g)) for g in (image_grid_thw.tolist() if image_grid_thw is not None else [])],
        _VIDEO: _video_blocks(video_grid_thw, video_time_scales, video_frames_apart),
    }
    for row in range(batch):
        if mask[row].any():
            positions[:, row, mask[row]] = _row_positions(kinds[row][mask[row]], queues, spatial_merge_size,
                                                          f"row {row}")
    for kind, name in ((_IMAGE, "image"), (_VIDEO, "video")):
        if queues[kind]:
            raise ValueError(f"{name}_grid_thw has {len(queues[kind])} more {name}s than the batch has {name} "
                             "tokens for")
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
