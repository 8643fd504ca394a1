"""The Megatron model of a vision-language checkpoint: GPTModel with mRoPE, whose first pipeline stage runs the
vision tower and puts its features at the image tokens (models/vision.py says what is read from the checkpoint).

The vision tower is transformers' own module (Qwen2.5-VL's window-attention ViT with 2-D rotary and patch merger;
Qwen3-VL's ViT with learned position embeddings interpolated to each image's grid, its patch merger and DeepStack
mergers), whole on every tensor-parallel rank of the first stage: it is small beside the language model (0.67 B of
Qwen2.5-VL-7B's 8.3 B parameters) and its inputs are the same on every TP rank, so every rank computes the same
features and receives the same gradient for them (the first layer's column-parallel input all-reduces its gradient).
Under sequence parallelism each TP rank places the features of its own slice of the sequence; its vision
parameters are then marked ``sequence_parallel`` so that Megatron's ``finalize_model_grads`` sums their gradients
over TP, as it does for the norms.

Qwen3-VL beyond Qwen2.5-VL:

- interleaved mRoPE (``InterleavedMultimodalRotaryEmbedding``): frequency pair j of a head turns by the t, h or w
  position as models/mrope.py ``interleaved_mrope_axes`` says, where Megatron-Core's MultimodalRotaryEmbedding
  takes them in sections; the same [T, B, 1, head_dim] embedding (rotate-half layout) Megatron's attention applies.
- DeepStack: the tower's mergers of blocks ``deepstack_visual_indexes`` give one more feature per image token each;
  the k-th is added to the hidden states at the image tokens right after language layer k (transformers'
  ``Qwen3VLTextModel._deepstack_process``), so layers 0..k-1 must be on the first pipeline stage (refused by name
  otherwise). The features ride to those layers as the decoder's ``context`` (unused by a GPT layer, whose
  cross-attention is an identity, and passed through each layer unchanged): a forward hook on each of the first k
  layers adds its feature to the layer's output. Riding as a layer input, they are saved and given their gradient
  by Megatron's activation recompute like the hidden states (a tensor captured by a hook would be read at
  recompute time from whichever micro-batch ran last, and backpropagated through the tower twice).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel
from torch import Tensor

from megatron_rl.models.mrope import interleaved_mrope_axes
from megatron_rl.models.vision import VisionSpec

__all__ = ["InterleavedMultimodalRotaryEmbedding", "VisionLanguageModel", "VisualInputs", "vision_tensor_shapes",
           "vision_tower"]


class VisualInputs(NamedTuple):
    """One kind (images or videos) of a micro-batch's visual inputs: the processor's pixels and grids of all its
    items in row order, and the [B, T] placeholder mask (models/vision_inputs.py; None: every placeholder id)."""

    pixels: Tensor | None = None
    grid_thw: Tensor | None = None
    mask: Tensor | None = None


def _tower_classes(family: str) -> tuple[type, type]:
    """(transformers' vision config class, its vision model class) for ``family``."""
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VLVisionConfig, Qwen2_5_VisionTransformerPretrainedModel
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionConfig, Qwen3VLVisionModel
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


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """Qwen3-VL's interleaved mRoPE: each rotary frequency pair turns by the temporal, height or width position of
    the token as ``interleaved_mrope_axes(mrope_section)`` says (transformers' ``Qwen3VLTextRotaryEmbedding``).
    Returns what Megatron's MultimodalRotaryEmbedding returns: [T, B, 1, dim], the angles twice (rotate-half)."""

    def forward(self, position_ids: Tensor, mrope_section: list[int],
                cp_group: torch.distributed.ProcessGroup | None = None) -> Tensor:
        if self.rotary_interleaved:
            raise ValueError("interleaved mRoPE is built for rotate-half rotary (rotary_interleaved=False), as "
                             "Qwen3-VL's")
        seq = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            seq = seq / self.seq_len_interpolation_factor
        freqs = seq[..., None] * self.inv_freq  # [3, B, T, dim / 2]
        axes = interleaved_mrope_axes(mrope_section, freqs.shape[-1]).to(freqs.device)
        freqs = freqs.gather(0, axes.expand(1, *freqs.shape[1:]))[0]  # [B, T, dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :].transpose(0, 1).contiguous()  # [T, B, 1, dim]
        cp_group = cp_group if cp_group is not None else self.cp_group
        if cp_group is not None and cp_group.size() > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb


class VisionLanguageModel(GPTModel):
    """GPTModel (``position_embedding_type="mrope"``) plus, on the first pipeline stage, ``vision``: the tower.

    ``forward`` takes mRoPE positions [3, B, T] (models/mrope.py ``mrope_position_ids``) and, on the first stage,
    the processor's ``pixel_values`` [num_patches, C * T_p * P * P] and ``image_grid_thw`` [num_images, 3] of the
    micro-batch's images in row order; rows without images need none."""

    def __init__(self, *args: Any, vision: VisionSpec, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.vision_spec = vision
        self.vision = None
        if vision.mrope_interleaved:
            self.rotary_pos_emb = InterleavedMultimodalRotaryEmbedding(
                kv_channels=self.config.kv_channels, rotary_percent=kwargs.get("rotary_percent", 1.0),
                rotary_interleaved=self.config.rotary_interleaved,
                seq_len_interpolation_factor=kwargs.get("seq_len_interpolation_factor"),
                rotary_base=kwargs.get("rotary_base", 10000))
        if self.pre_process:
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            self.vision = vision_tower(vision, self.config.params_dtype, device)
            for param in self.vision.parameters():
                param.sequence_parallel = bool(self.config.sequence_parallel)
            self._hook_deepstack()

    def _hook_deepstack(self) -> None:
        """DeepStack: a forward hook on each of language layers 0..k-1 (k deepstack features), all on this stage."""
        count = len(self.vision_spec.deepstack_visual_indexes)
        if not count:
            return
        held = [layer.layer_number - 1 for layer in self.decoder.layers]
        if held[:count] != list(range(count)):
            raise ValueError(
                f"DeepStack adds vision features (blocks {list(self.vision_spec.deepstack_visual_indexes)}) after "
                f"language layers 0..{count - 1}, which must all be on the first pipeline stage; it holds "
                f"{len(held)} language layers{f' ({held[0]}..{held[-1]})' if held else ''}: give the first stage at "
                f"least {count} layers (num_layers_in_first_pipeline_stage / pipeline_model_parallel_layout)")
        for index in range(count):
            self.decoder.layers[index].register_forward_hook(functools.partial(_add_deepstack, index),
                                                             with_kwargs=True)

    def forward(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, *,
                pixel_values: Tensor | None = None, image_grid_thw: Tensor | None = None,
                image_mask: Tensor | None = None, pixel_values_videos: Tensor | None = None,
                video_grid_thw: Tensor | None = None, video_mask: Tensor | None = None,
                decoder_input: Tensor | None = None, **kwargs: Any) -> Tensor:
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"a vision-language model takes mRoPE position_ids [3, batch, tokens] "
                             f"(models/mrope.py), got shape {tuple(position_ids.shape)}")
        if self.pre_process and decoder_input is None:
            decoder_input, deepstack = self.embed_with_deepstack(
                input_ids, VisualInputs(pixel_values, image_grid_thw, image_mask),
                VisualInputs(pixel_values_videos, video_grid_thw, video_mask))
            if deepstack is not None:  # the decoder's context, to the hooks of the first layers (_add_deepstack)
                kwargs["extra_block_kwargs"] = {**(kwargs.get("extra_block_kwargs") or {}), "context": deepstack}
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)

    def visual_features(self, pixel_values: Tensor, grid_thw: Tensor) -> tuple[Tensor, list[Tensor]]:
        """([tokens, hidden]: the merged features of every image (or video), in order; the DeepStack features, one
        [tokens, hidden] per ``deepstack_visual_indexes`` entry, none for Qwen2.5-VL). Videos go through the same
        tower as images, their frames grouped by the temporal patch."""
        output = self.vision(pixel_values.to(self.config.params_dtype), grid_thw=grid_thw)
        return output.pooler_output, list(getattr(output, "deepstack_features", None) or [])

    def embed_with_deepstack(self, input_ids: Tensor, images: VisualInputs | None = None,
                             videos: VisualInputs | None = None) -> tuple[Tensor, Tensor | None]:
        """(the decoder input [T (/ TP under sequence parallelism), B, hidden]: token embeddings, with each image
        (video) placeholder's replaced by the next image (video) feature in (row, position) order, as transformers
        places them; the DeepStack features of images and videos placed in the same
        layout [k, T (/ TP), B, hidden], zero away from their tokens; None without any or without DeepStack)."""
        embeddings = self.embedding(input_ids=input_ids, position_ids=None)
        decoder_input, deepstack = embeddings, None
        spec = self.vision_spec
        for name, token_id, inputs in (("image", spec.image_token_id, images), ("video", spec.video_token_id, videos)):
            inputs = inputs or VisualInputs()
            where = input_ids == token_id if inputs.mask is None else inputs.mask.bool()
            count = int(where.sum())
            if inputs.pixels is None:
                if count:
                    raise ValueError(f"the micro-batch has {count} {name} tokens (id {token_id}) but no {name} "
                                     "pixels")
                continue
            features, stack = self.visual_features(inputs.pixels, inputs.grid_thw)
            if features.shape[0] != count:
                raise ValueError(f"{features.shape[0]} {name} features ({name} grid_thw {inputs.grid_thw.tolist()}) "
                                 f"for {count} {name} tokens in input_ids of shape {tuple(input_ids.shape)}")
            place = self._placer(where, embeddings.shape[0])
            decoder_input = place(features, decoder_input)
            if stack:
                zero = embeddings.new_zeros(())
                placed = torch.stack([place(f, zero) for f in stack])
                deepstack = placed if deepstack is None else deepstack + placed  # images and videos never overlap
        return decoder_input, deepstack

    def _placer(self, where: Tensor, rows: int) -> Callable[[Tensor, Tensor], Tensor]:
        """``place(source, elsewhere)``: [T (/ TP), B, hidden] with ``source``'s rows at the tokens ``where`` [B, T]
        marks, in (row, position) order, and ``elsewhere`` at the others."""
        # [T, B] as the embeddings are laid out (contiguous: the result's layout follows its inputs', and pipeline
        # stages send it on)
        order = (where.reshape(-1).cumsum(0) - 1).reshape(where.shape).t().contiguous()  # feature index per token
        where = where.t().contiguous()
        if self.config.sequence_parallel:  # this rank's slice of the sequence
            start = parallel_state.get_tensor_model_parallel_rank() * rows
            order, where = order[start:start + rows], where[start:start + rows]
        at, index = where.unsqueeze(-1), order.clamp(min=0)

        def place(source: Tensor, elsewhere: Tensor) -> Tensor:
            return torch.where(at, source.to(elsewhere.dtype)[index], elsewhere)

        return place


def _add_deepstack(index: int, layer: torch.nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple | None:
    """Forward hook of language layer ``index``: its output hidden states plus the ``index``-th DeepStack feature
    (the decoder's context, ``VisionLanguageModel.embed_with_deepstack``); nothing without images."""
    features = kwargs.get("context")
    if features is None:
        return None
    hidden, context = output
    return hidden + features[index], context
