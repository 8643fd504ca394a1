"""What a micro-batch gives the model beyond token ids and masks: positions (1-D, or mRoPE's [3, B, T] for a
vision-language model) and the images of its rows.

A batch carries each row's processor outputs as verl does (``multi_modal_inputs``: ``pixel_values`` [patches, ...] and
``image_grid_thw`` [images, 3], or nothing for a text-only row); a micro-batch's are concatenated in row order, the
order in which the model places image features at the image tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.mrope import mrope_position_ids

__all__ = ["MULTI_MODAL_INPUTS", "collate_images", "image_token_mask", "model_inputs", "position_ids_from_mask",
           "vision_model_inputs"]

# verl's non-tensor column of each row's processor outputs (pixel_values, image_grid_thw)
MULTI_MODAL_INPUTS = "multi_modal_inputs"


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's convention: position = number of real tokens before this one (pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def collate_images(rows: Sequence[Mapping[str, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """``pixel_values`` and ``image_grid_thw`` of ``rows`` (each a row's ``multi_modal_inputs`` or None) concatenated
    in row order; {} when no row has an image."""
    with_images = [r for r in rows if r and r.get("image_grid_thw") is not None and len(r["image_grid_thw"])]
    if not with_images:
        return {}
    return {key: torch.cat([torch.as_tensor(r[key]) for r in with_images]) for key in ("pixel_values", "image_grid_thw")}


def image_token_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     images: Sequence[Mapping[str, torch.Tensor] | None], image_token_id: int,
                     spatial_merge_size: int) -> torch.Tensor:
    """[B, T] True at each row's image placeholders: the first ``sum(t * h * w) / merge**2`` (its images' tokens)
    real tokens with ``image_token_id``. Any later one is a token the model generated in its response (a random or
    young policy may sample ``<|image_pad|>``): text, not an image."""
    is_image = (input_ids == image_token_id) & attention_mask.bool()
    for row, row_images in enumerate(images):
        grids = row_images.get("image_grid_thw") if row_images else None
        needed = int(torch.as_tensor(grids).prod(-1).sum()) // spatial_merge_size**2 if grids is not None else 0
        found = torch.cumsum(is_image[row].long(), 0)
        if int(found[-1]) < needed:
            raise ValueError(f"row {row}: its images need {needed} image tokens (id {image_token_id}), the row has "
                             f"{int(found[-1])}")
        is_image[row] &= found <= needed
    return is_image


def model_inputs(hf: HFModelConfig, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 images: Sequence[Mapping[str, torch.Tensor] | None] | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """(position_ids, keyword arguments of the model's forward) for rows ``input_ids`` / ``attention_mask`` [B, T] and
    their ``images`` (one entry per row). A text model refuses images."""
    if hf.vision is None:
        if images is not None and collate_images(images):
            raise ValueError(f"{hf.source}: {hf.architecture} is a text model; the batch has images "
                             "(multi_modal_inputs)")
        return position_ids_from_mask(attention_mask), {}
    return vision_model_inputs(input_ids, attention_mask, images, image_token_id=hf.vision.image_token_id,
                               spatial_merge_size=hf.vision.spatial_merge_size)


def vision_model_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        images: Sequence[Mapping[str, torch.Tensor] | None] | None, *, image_token_id: int,
                        spatial_merge_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A vision-language model's (mRoPE positions [3, B, T], {``pixel_values``, ``image_grid_thw`` of the rows' images
    in order (absent without images), ``image_mask`` [B, T]: the rows' image placeholders}); the Megatron model and
    the HF rollout engine both take their inputs from here."""
    rows = list(images) if images is not None else [None] * input_ids.shape[0]
    pixels = collate_images(rows)
    image_mask = image_token_mask(input_ids, attention_mask, rows, image_token_id, spatial_merge_size)
    positions = mrope_position_ids(input_ids, attention_mask, pixels.get("image_grid_thw"),
                                   image_token_id=image_token_id, spatial_merge_size=spatial_merge_size,
                                   image_mask=image_mask)
    return positions, {**pixels, "image_mask": image_mask}
