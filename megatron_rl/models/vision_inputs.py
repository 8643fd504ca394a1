"""What a micro-batch gives the model beyond token ids and masks: positions (1-D, or mRoPE's [3, B, T] for a
vision-language model) and the images and videos of its rows.

A batch carries each row's processor outputs as verl does (``multi_modal_inputs``: ``pixel_values`` [patches, ...] and
``image_grid_thw`` [images, 3]; for videos ``pixel_values_videos``, ``video_grid_thw`` [videos, 3] and, from
Qwen2.5-VL's processor, ``second_per_grid_ts`` [videos]; or nothing for a text-only row); a micro-batch's are
concatenated in row order, the order in which the model places the features at the placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.mrope import mrope_position_ids
from megatron_rl.models.vision import VisionSpec

__all__ = ["MULTI_MODAL_INPUTS", "collate_visual_inputs", "model_inputs", "placeholder_mask",
           "position_ids_from_mask", "vision_model_inputs"]

# verl's non-tensor column of each row's processor outputs (pixel_values, image_grid_thw, ...)
MULTI_MODAL_INPUTS = "multi_modal_inputs"
# (pixels, grid, extra per-item keys) of each kind of visual input, as the processors name them
_KINDS = {"image": ("pixel_values", "image_grid_thw", ()),
          "video": ("pixel_values_videos", "video_grid_thw", ("second_per_grid_ts",))}

Rows = Sequence[Mapping[str, torch.Tensor] | None]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's convention: position = number of real tokens before this one (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _has(row: Mapping[str, torch.Tensor] | None, grid_key: str) -> bool:
    return bool(row) and row.get(grid_key) is not None and len(row[grid_key]) > 0


def collate_visual_inputs(rows: Rows) -> dict[str, torch.Tensor]:
    """The images' and videos' processor outputs of ``rows`` (each a row's ``multi_modal_inputs`` or None)
    concatenated in row order, under the processor's names (what transformers' forward takes); {} when no row has
    an image or a video."""
    out = {}
    for pixels, grid, extra in _KINDS.values():
        with_items = [r for r in rows if _has(r, grid)]
        for key in (pixels, grid, *extra):
            values = [r.get(key) for r in with_items]
            if values and all(v is not None for v in values):
                out[key] = torch.cat([torch.as_tensor(v).reshape(-1) if key in extra else torch.as_tensor(v)
                                      for v in values])
    return out


def placeholder_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Rows, token_id: int,
                     grid_key: str, spatial_merge_size: int) -> torch.Tensor:
    """[B, T] True at each row's image (or video) placeholders: the first ``sum(t * h * w) / merge**2`` (its
    images' tokens, grids under ``grid_key``) real tokens with ``token_id``. Any later one is a token the model
    generated in its response (a random or young policy may sample ``<|image_pad|>``): text, not an image."""
    is_item = (input_ids == token_id) & attention_mask.bool()
    for row, row_inputs in enumerate(rows):
        grids = row_inputs.get(grid_key) if row_inputs else None
        needed = int(torch.as_tensor(grids).prod(-1).sum()) // spatial_merge_size**2 if grids is not None else 0
        found = torch.cumsum(is_item[row].long(), 0)
        if int(found[-1]) < needed:
            kind = grid_key.removesuffix("_grid_thw")
            raise ValueError(f"row {row}: its {kind}s need {needed} {kind} tokens (id {token_id}), the row has "
                             f"{int(found[-1])}")
        is_item[row] &= found <= needed
    return is_item


def model_inputs(hf: HFModelConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 rows: Rows | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """(position_ids, keyword arguments of the model's forward) for rows ``input_ids`` / ``attention_mask`` [B, T] and
    their ``rows`` (each row's ``multi_modal_inputs``). A text model refuses images and videos."""
    if hf.vision is None:
        if rows is not None and collate_visual_inputs(rows):
            raise ValueError(f"{hf.source}: {hf.architecture} is a text model; the batch has images or videos "
                             "(multi_modal_inputs)")
        return position_ids_from_mask(attention_mask), {}
    return vision_model_inputs(input_ids, attention_mask, rows, hf.vision)


def vision_model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: Rows | None,
                        spec: VisionSpec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A vision-language model's (mRoPE positions [3, B, T], {``pixel_values`` / ``image_grid_thw`` and
    ``pixel_values_videos`` / ``video_grid_thw`` of the rows' images and videos in order (each absent without
    any), ``image_mask`` / ``video_mask`` [B, T]: the rows' placeholders}); the Megatron model and the HF rollout
    engine both take their inputs from here."""
    rows = list(rows) if rows is not None else [None] * input_ids.shape[0]
    visual = collate_visual_inputs(rows)
    merge = spec.spatial_merge_size
    image_mask = placeholder_mask(input_ids, attention_mask, rows, spec.image_token_id, "image_grid_thw", merge)
    video_mask = placeholder_mask(input_ids, attention_mask, rows, spec.video_token_id, "video_grid_thw", merge)
    seconds = visual.pop("second_per_grid_ts", None)
    scales = None if seconds is None else (seconds.float() * spec.tokens_per_second).tolist()
    positions = mrope_position_ids(input_ids, attention_mask, visual.get("image_grid_thw"),
                                   image_token_id=spec.image_token_id, spatial_merge_size=merge,
                                   image_mask=image_mask, video_grid_thw=visual.get("video_grid_thw"),
                                   video_mask=video_mask, video_time_scales=scales,
                                   video_frames_apart=spec.video_frames_apart)
    return positions, {**visual, "image_mask": image_mask, "video_mask": video_mask}
