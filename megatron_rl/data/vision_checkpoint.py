"""A tiny random vision-language checkpoint (Qwen2.5-VL or Qwen3-VL architecture) for tests and CPU demos.

The directory holds what a real checkpoint holds: ``config.json`` + weights, a tokenizer with Qwen-VL's
vision tokens and a chat template that renders image and video parts as Qwen-VL's does, the image processor's
``preprocessor_config.json`` (small pixel limits, so a test image is a few patches) and the video processor's
``video_preprocessor_config.json`` (the same normalisation and patches; limits of the family's meaning). Everything
loads offline through the usual ``from_pretrained`` paths (megatron_rl.data.multimodal.load_processor; transformers'
own video processor where torchvision is installed, megatron_rl.data.video_processor's stand-in where not).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_rl.data.tokenizer import IM_START, build_tiny_tokenizer, load_tokenizer

__all__ = ["VL_FAMILIES", "VL_SPECIAL_TOKENS", "VL_CHAT_TEMPLATE", "build_tiny_vl_checkpoint"]

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"
IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
VL_SPECIAL_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Qwen2.5-VL's template (ChatML; an image part becomes <|vision_start|><|image_pad|><|vision_end|>, which the
# processor expands to the image's tokens), less its default system message: like CHATML_TEMPLATE, the tiny
# models are prompted with the rows' own messages only.
VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# family -> (processor class, patch size): the patch size is the architecture's (Qwen3-VL: 16)
VL_FAMILIES = {"qwen2_5_vl": ("Qwen2_5_VLProcessor", 14), "qwen3_vl": ("Qwen3VLProcessor", 16)}
# family -> its video processor: Qwen2-VL's bounds each frame's pixels, Qwen3-VL's frames * height * width
_VIDEO_PROCESSORS = {"qwen2_5_vl": "Qwen2VLVideoProcessor", "qwen3_vl": "Qwen3VLVideoProcessor"}
_VIDEO_FRAMES_AT_MAX = 8  # Qwen3-VL's video limit: this many frames at the image limit
# CLIP's normalisation, which Qwen-VL's image processors use
_IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
_IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


def build_tiny_vl_checkpoint(
    out_dir: str | Path,
    texts: Iterable[str],
    *,
    seed: int = 0,
    family: str = "qwen2_5_vl",
    vocab_size: int = 128,
    hidden_size: int = 64,
    layers: int = 2,
    attention_heads: tuple[int, int] = (4, 2),
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    vision_heads: int = 2,
    max_positions: int = 256,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> Path:
    """Write a random tiny VL model, its tokenizer (trained on ``texts``) and processor files to ``out_dir``.

    The pixel limits default to 1x1 .. 4x4 merged patches (28x28 .. 112x112 pixels at patch size 14), so a
    test image is at most 16 image tokens; Qwen2.5-VL's window attention then spans 2x2 merged patches, fewer
    than an image has, and the last vision block attends fully (``fullatt_block_indexes``).
    """
    if family not in VL_FAMILIES:
        raise ValueError(f"unknown vision-language family {family!r}; known: {sorted(VL_FAMILIES)}")
    processor_class, patch_size = VL_FAMILIES[family]
    merge = 2
    factor = patch_size * merge
    out_dir = Path(out_dir)
    tokenizer = _build_vl_tokenizer(out_dir, texts, vocab_size)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in VL_SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=attention_heads[0], num_key_value_heads=attention_heads[1],
        max_position_embeddings=max_positions, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    half_head = hidden_size // attention_heads[0] // 2
    # mRoPE splits each head's rotary half into (time, height, width) sections
    mrope = [half_head - 2 * (half_head * 3 // 8), half_head * 3 // 8, half_head * 3 // 8]
    vision = dict(depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                  num_heads=vision_heads, patch_size=patch_size, spatial_merge_size=merge, temporal_patch_size=2,
                  out_hidden_size=hidden_size)
    token_ids = dict(image_token_id=ids[IMAGE_PAD], video_token_id=ids[VIDEO_PAD],
                     vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END])
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model

        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": mrope}
        vision.update(window_size=2 * factor, fullatt_block_indexes=[vision_depth - 1])
    else:
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model

        text.update(head_dim=hidden_size // attention_heads[0], rope_parameters={
            "rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": mrope, "mrope_interleaved": True})
        # learned position embeddings on an 8x8 patch grid (interpolated to the image's); deepstack: last block
        vision.update(num_position_embeddings=64, deepstack_visual_indexes=[vision_depth - 1])
    config = Config(text_config=text, vision_config=vision, tie_word_embeddings=False, **token_ids)
    torch.manual_seed(seed)
    Model(config).save_pretrained(out_dir)
    min_pixels = min_pixels if min_pixels is not None else factor * factor
    max_pixels = max_pixels if max_pixels is not None else 16 * factor * factor
    _write_processor_config(out_dir, processor_class, patch_size, min_pixels, max_pixels)
    _write_video_processor_config(out_dir, family, processor_class, patch_size, min_pixels, max_pixels)
    return out_dir


def _build_vl_tokenizer(out_dir: Path, texts: Iterable[str], vocab_size: int):
    """build_tiny_tokenizer's tokenizer plus the vision tokens (appended as special tokens) and the VL template."""
    tokenizer = build_tiny_tokenizer(out_dir, texts, vocab_size=vocab_size)
    # the list replaces the special tokens other than pad/eos/unk: keep <|im_start|>
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, *VL_SPECIAL_TOKENS]})
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # in tokenizer_config.json, for older readers
    (out_dir / "chat_template.jinja").write_text(VL_CHAT_TEMPLATE)  # the processor's, as VL checkpoints ship it
    return load_tokenizer(out_dir)


def _write_processor_config(out_dir: Path, processor_class: str, patch_size: int, min_pixels: int,
                            max_pixels: int) -> None:
    """``preprocessor_config.json`` as Qwen-VL checkpoints ship it: the auto classes read it."""
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": processor_class,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": list(_IMAGE_MEAN), "image_std": list(_IMAGE_STD),
        "min_pixels": min_pixels, "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
        "patch_size": patch_size, "temporal_patch_size": 2, "merge_size": 2,
    }
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _write_video_processor_config(out_dir: Path, family: str, processor_class: str, patch_size: int, min_pixels: int,
                                  max_pixels: int) -> None:
    """``video_preprocessor_config.json``: what AutoVideoProcessor (and the torchvision-free stand-in) read; without
    it both fall back to the image processor's file, whose limits mean per image what Qwen3-VL's mean per video."""
    if family == "qwen3_vl":
        size = {"shortest_edge": min_pixels * 2, "longest_edge": max_pixels * _VIDEO_FRAMES_AT_MAX}
    else:
        size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    config = {
        "video_processor_type": _VIDEO_PROCESSORS[family],
        "processor_class": processor_class,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True, "image_mean": list(_IMAGE_MEAN), "image_std": list(_IMAGE_STD), "size": size,
        "patch_size": patch_size, "temporal_patch_size": 2, "merge_size": 2,
        # frames come sampled (megatron_rl.data.video.load_video, verl's process_video)
        "do_sample_frames": False, "min_frames": 4, "max_frames": 768,
    }
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
