"""Tiny Qwen2.5-VL and Qwen3-VL checkpoints and an image+text batch for the vision-language model tests (no tokenizer, no
processor: token ids and pixel values are made up directly; the data tests use the processor)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, IMAGE, VIDEO, VISION_START = 160, 150, 151, 152
PATCH, MERGE, TEMPORAL = 14, 2, 2
QWEN3_VL_PATCH = 16


def tiny_qwen2_5_vl_config(**text_overrides):
    from transformers import Qwen2_5_VLConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    text.update(text_overrides)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                            vision_start_token_id=VISION_START)


def make_tiny_qwen2_5_vl(out_dir: Path, seed: int = 0, **text_overrides) -> Path:
    """A random tiny Qwen2.5-VL saved with transformers (its norms and biases perturbed, so a layout bug in any of
    them shows in the logits)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config(**text_overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return Path(out_dir)


def tiny_qwen3_vl_config(deepstack=(0, 1), **text_overrides):
    """A tiny Qwen3-VL: 4 language layers with interleaved mRoPE (head_dim 32: 16 frequency pairs, mrope_section
    [6, 6, 4], so the height and width pairs stop at different places, 18 and 12) and a 3-block tower whose blocks
    ``deepstack`` feed DeepStack, its learned position grid (6 x 6) interpolated to every image's."""
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [6, 6, 4], "mrope_interleaved": True,
                                 "rope_theta": 10000.0})
    text.update(text_overrides)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=QWEN3_VL_PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                  num_position_embeddings=36, deepstack_visual_indexes=list(deepstack))
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                         vision_start_token_id=VISION_START)


def make_tiny_qwen3_vl(out_dir: Path, seed: int = 0, deepstack=(0, 1), **text_overrides) -> Path:
    """A random tiny Qwen3-VL saved with transformers (its checkpoint names: ``model.language_model.*``,
    ``model.visual.*``, ``lm_head.weight``), norms and biases perturbed as ``make_tiny_qwen2_5_vl``'s."""
    from transformers import Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(deepstack, **text_overrides))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(out_dir)
    return Path(out_dir)


def image_text_batch(patch: int = PATCH) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor] | None]]:
    """(input_ids, attention_mask, per-row images) of three rows: an 8x8-patch image (16 tokens) between text, left
    padded; a 4x6-patch image (6 tokens) and a 2x2 one (1 token), right padded; text only, padded both sides.
    ``patch``: the model's patch size (Qwen2.5-VL's 14, Qwen3-VL's 16), which sizes only the pixel values."""
    gen = torch.Generator().manual_seed(0)
    grids = [[[1, 8, 8]], [[1, 4, 6], [1, 2, 2]], []]
    rows, images = [], []
    for row_grids in grids:
        ids = torch.randint(0, IMAGE, (3,), generator=gen).tolist()
        for t, h, w in row_grids:
            ids += [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + torch.randint(0, IMAGE, (2,), generator=gen).tolist()
        rows.append(ids)
        if row_grids:
            patches = sum(t * h * w for t, h, w in row_grids)
            images.append({"pixel_values": torch.randn(patches, 3 * TEMPORAL * patch * patch, generator=gen),
                           "image_grid_thw": torch.tensor(row_grids)})
        else:
            images.append(None)
    width = max(len(r) for r in rows) + 3
    width += width % 2  # sequence parallelism at TP 2 splits the sequence in halves
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    starts = [width - len(rows[0]), 0, 1]  # left, right, both sides
    for i, (ids, start) in enumerate(zip(rows, starts)):
        input_ids[i, start:start + len(ids)] = torch.tensor(ids)
        attention_mask[i, start:start + len(ids)] = 1
    return input_ids, attention_mask, images
