"""The Megatron model of a vision-language checkpoint: GPTModel with mRoPE, whose first pipeline stage runs the
vision tower and puts its features at the image tokens (models/vision.py says what is read from the checkpoint).

The vision tower is transformers' own module (Qwen2.5-VL's window-attention ViT with 2-D rotary and patch merger),
whole on every tensor-parallel rank of the first stage: it is small beside the language model (0.67 B of
Qwen2.5-VL-7B's 8.3 B parameters) and its inputs are the same on every TP rank, so every rank computes the same
features and receives the same gradient for them (the first layer's column-parallel input all-reduces its gradient).
Under sequence parallelism each TP rank places the features of its own slice of the sequence; its vision
parameters are then marked ``sequence_parallel`` so that Megatron's ``finalize_model_grads`` sums their gradients
over TP, as it does for the norms.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from torch import Tensor

from megatron_rl.models.vision import VisionSpec

__all__ = ["VisionLanguageModel", "vision_tensor_shapes", "vision_tower"]


def _tower_classes(family: str) -> tuple[type, type]:
    """(transformers' vision config class, its vision model class) for ``family``."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel
    raise ValueError(f"the {family} vision tower is not built here")


def vision_tower(spec: VisionSpec, dtype: torch.dtype = torch.float32, device: Any = None) -> torch.nn.Module:
    """transformers' vision tower of ``spec``, randomly initialised (weights are loaded after)."""
    config_cls, model_cls = _tower_classes(spec.family)
    config = config_cls(**spec.config)
    config._attn_implementation = "sdpa"
    tower = model_cls._from_config(config, dtype=dtype)
    return tower.to(device) if device is not None else tower


@functools.lru_cache(maxsize=8)
def _shapes(family: str, config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    config_cls, model_cls = _tower_classes(family)
    with torch.device("meta"):
        tower = model_cls._from_config(config_cls(**json.loads(config_json)))
    return tuple((name, tuple(p.shape)) for name, p in tower.named_parameters())


def vision_tensor_shapes(spec: VisionSpec) -> dict[str, tuple[int, ...]]:
    """The vision tower's parameters by their name inside the tower (checkpoint name: ``spec.vision_prefix`` +
    it), with their shapes, in the tower's order; built on the meta device (no memory)."""
    return dict(_shapes(spec.family, json.dumps(spec.config, sort_keys=True)))


class VisionLanguageModel(GPTModel):
    """GPTModel (``position_embedding_type="mrope"``) plus, on the first pipeline stage, ``vision``: the tower.

    ``forward`` takes mRoPE positions [3, B, T] (models/mrope.py ``mrope_position_ids``) and, on the first stage,
    the processor's ``pixel_values`` [num_patches, C * T_p * P * P] and ``image_grid_thw`` [num_images, 3] of the
    micro-batch's images in row order; rows without images need none."""

    def __init__(self, *args: Any, vision: VisionSpec, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vision_spec = vision
        self.vision = None
        if self.pre_process:
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            self.vision = vision_tower(vision, self.config.params_dtype, device)
            for param in self.vision.parameters():
                param.sequence_parallel = bool(self.config.sequence_parallel)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, *,
                pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
                decoder_input: Tensor | None = None, **kwargs: Any) -> Tensor:
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"a vision-language model takes mRoPE position_ids [3, batch, tokens] "
                             f"(models/mrope.py), got shape {tuple(position_ids.shape)}")
        if self.pre_process and decoder_input is None:
            decoder_input = self.embed(input_ids, pixel_values, image_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

    def image_features(self, pixel_values: Tensor, image_grid_thw: Tensor) -> Tensor:
        """[image tokens, hidden]: the merged features of every image, in order."""
        output = self.vision(pixel_values.to(self.config.params_dtype), grid_thw=image_grid_thw)
        return output.pooler_output

    def embed(self, input_ids: Tensor, pixel_values: Tensor | None, image_grid_thw: Tensor | None) -> Tensor:
        """The decoder input [T (/ TP under sequence parallelism), B, hidden]: token embeddings, with each image
        token's replaced by the next image feature in (row, position) order, as transformers places them."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        image = input_ids == self.vision_spec.image_token_id
        count = int(image.sum())
        if pixel_values is None:
            if count:
                raise ValueError(f"the micro-batch has {count} image tokens (id {self.vision_spec.image_token_id}) "
                                 "but no pixel_values")
            return embeddings
        features = self.image_features(pixel_values, image_grid_thw)
        if features.shape[0] != count:
            raise ValueError(f"{features.shape[0]} image features (image_grid_thw {image_grid_thw.tolist()}) for "
                             f"{count} image tokens in input_ids of shape {tuple(input_ids.shape)}")
        # [T, B] as the embeddings are laid out (contiguous: the result's layout follows its inputs', and pipeline
        # stages send it on)
        order = (image.reshape(-1).cumsum(0) - 1).reshape(image.shape).t().contiguous()  # feature index per token
        image = image.t().contiguous()
        if self.config.sequence_parallel:  # this rank's slice of the sequence
            rows = embeddings.shape[0]
            start = parallel_state.get_tensor_model_parallel_rank() * rows
            order, image = order[start:start + rows], image[start:start + rows]
        placed = features.to(embeddings.dtype)[order.clamp(min=0)]
        return torch.where(image.unsqueeze(-1), placed, embeddings)
