"""Tiny Qwen2.5-VL and Qwen3-VL checkpoints and an image+video+text batch for the vision-language model tests (no tokenizer, no
processor: token ids and pixel values are made up directly; the data tests use the processor)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, IMAGE, VIDEO, VISION_START, VISION_END = 160, 150, 151, 152, 153
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


def visual_text_batch(patch: int = PATCH, frames_apart: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor] | None]]:
    """(input_ids, attention_mask, per-row ``multi_modal_inputs``) of three rows: an 8x8-patch image (16 tokens)
    between text, left padded; a 4x6-patch image (6 tokens), a 2x2 one (1 token) and a video of 2 temporal patches of
    4x4 (8 tokens, an eighth of a second a patch: temporal positions 0 and 0.5 -> 0 at the tiny configs' 4 tokens a
    second, not the 0 and 1 of a scale left out; below its 2x2 merged grid, where transformers 5.19 and verl agree:
    models/mrope.py), right padded; text only, padded both sides.
    ``patch``: the model's patch size (Qwen2.5-VL's 14, Qwen3-VL's 16), which sizes only the pixel values.
    ``frames_apart``: Qwen3-VL's video layout, each temporal patch behind its own timestamp text and vision start
    (no ``second_per_grid_ts``)."""
    gen = torch.Generator().manual_seed(0)
    items = [[("image", (1, 8, 8))], [("image", (1, 4, 6)), ("image", (1, 2, 2)), ("video", (2, 4, 4))], []]
    rows, inputs = [], []
    for row_items in items:
        ids = torch.randint(0, IMAGE, (3,), generator=gen).tolist()
        for kind, (t, h, w) in row_items:
            token = IMAGE if kind == "image" else VIDEO
            if kind == "video" and frames_apart:  # "<t seconds>" text, then one vision block per temporal patch
                for _ in range(t):
                    ids += torch.randint(0, IMAGE, (2,), generator=gen).tolist()
                    ids += [VISION_START] + [token] * (h * w // MERGE**2) + [VISION_END]
            else:
                ids += [VISION_START] + [token] * (t * h * w // MERGE**2)
            ids += torch.randint(0, IMAGE, (2,), generator=gen).tolist()
        rows.append(ids)
        row: dict[str, torch.Tensor] = {}
        for kind, pixels_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                           ("video", "pixel_values_videos", "video_grid_thw")):
            grids = [g for k, g in row_items if k == kind]
            if grids:
                patches = sum(t * h * w for t, h, w in grids)
                row[pixels_key] = torch.randn(patches, 3 * TEMPORAL * patch * patch, generator=gen)
                row[grid_key] = torch.tensor(grids)
        if "video_grid_thw" in row and not frames_apart:
            row["second_per_grid_ts"] = torch.tensor([0.125])
        inputs.append(row or None)
    width = max(len(r) for r in rows) + 3
    width += width % 2  # sequence parallelism at TP 2 splits the sequence in halves
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    starts = [width - len(rows[0]), 0, 1]  # left, right, both sides
    for i, (ids, start) in enumerate(zip(rows, starts)):
        input_ids[i, start:start + len(ids)] = torch.tensor(ids)
        attention_mask[i, start:start + len(ids)] = 1
    return input_ids, attention_mask, inputs


def mm_token_types(input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' ``mm_token_type_ids`` of a ``visual_text_batch``: 1 at image tokens, 2 at video tokens."""
    return (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
