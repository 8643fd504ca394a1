"""Qwen2.5-VL on Megatron-Core against transformers: the config read (language model + vision spec), mRoPE positions
equal to transformers' get_rope_index (and for videos to verl's, where transformers 5.19 departs from it), and on an
image+video+text batch (three rows, left/right/both padding, two images and a video in one row, a text-only row) the
logits (fp32, within 1e-5), the gradients of the vision tower and of language-model norms, and the exact export round
trip, at TP 1/2 (with and without sequence parallelism) and PP 2 on 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import UnsupportedModelError, parse_hf_config
from megatron_rl.models.vision_inputs import collate_visual_inputs, model_inputs
from megatron_rl_testing.vl_configs import QWEN2_5_VL_7B
from megatron_rl_testing.verl_oracle import verl_module
from megatron_rl_testing.vl_models import (IMAGE, VIDEO, VISION_START, make_tiny_qwen2_5_vl, mm_token_types,
                                         tiny_qwen2_5_vl_config, visual_text_batch)
from vision_jobs import (GRAD_PARAMS, assert_export_exact, assert_grads_match, assert_logits_match, hf_reference,
                         layout_checks)

TOLERANCE = 1e-5
LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]
# Qwen2.5-VL-7B-Instruct's config.json as released (transformers 4.x layout: language fields at the top level)
RELEASED_7B = QWEN2_5_VL_7B


def _tiny_config() -> dict:
    """The tiny config as transformers 5 writes it to config.json (a text_config section, rope_parameters)."""
    return {**tiny_qwen2_5_vl_config().to_dict(), "architectures": ["Qwen2_5_VLForConditionalGeneration"]}


def test_released_and_transformers5_configs_read_the_same_language_model():
    released = parse_hf_config(RELEASED_7B)
    assert (released.architecture, released.model_type, released.qkv_bias, released.qk_norm) == (
        "Qwen2_5_VLForConditionalGeneration", "qwen2", True, False)
    assert (released.num_layers, released.hidden_size, released.head_dim, released.rope_theta) == (28, 3584, 128, 1e6)
    assert released.vision.mrope_section == (16, 24, 24) and not released.vision.mrope_interleaved
    assert (released.vision.image_token_id, released.vision.vision_prefix) == (151655, "visual.")
    tiny = parse_hf_config(_tiny_config())
    assert (tiny.num_layers, tiny.hidden_size, tiny.vocab_size, tiny.vision.mrope_section) == (2, 64, 160, (2, 3, 3))
    assert tiny.vision.depth == 2 and tiny.vision.out_hidden_size == 64


@pytest.mark.parametrize("change, message", [
    (lambda c: c["rope_scaling"].update(mrope_section=[16, 24]), r"mrope_section \[t, h, w\]"),
    (lambda c: c["rope_scaling"].update(mrope_section=[16, 24, 20]), r"covers 120 dims of head_dim=128"),
    (lambda c: c.pop("vision_config"), r"without a vision_config"),
])
def test_bad_vision_language_configs_are_refused_by_name(change, message):
    config = json.loads(json.dumps(RELEASED_7B))
    change(config)
    with pytest.raises(UnsupportedModelError, match=message):
        parse_hf_config(config, source="x/config.json")


def test_mrope_positions_equal_transformers_get_rope_index(tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config())
    input_ids, attention_mask, rows = visual_text_batch()
    visual = collate_visual_inputs(rows)
    expected, _ = model.model.get_rope_index(input_ids, mm_token_types(input_ids), image_grid_thw=visual["image_grid_thw"],
                                             video_grid_thw=visual["video_grid_thw"],
                                             second_per_grid_ts=visual["second_per_grid_ts"],
                                             attention_mask=attention_mask)
    ours, _ = model_inputs(parse_hf_config(_tiny_config()), input_ids, attention_mask, rows)
    valid = attention_mask.bool()
    assert torch.equal(ours[:, valid], expected[:, valid])
    assert ours[:, 0].max() < ours.shape[-1]  # the image's grid compresses positions below the token count


@pytest.mark.parametrize("seconds", [0.5, 1.5, 2 / 3])
def test_video_positions_equal_verls_get_rope_index(seconds):
    """A video whose temporal positions run past its height and width (1.5 s a patch: 0, 3, 6 against a 2x2 grid):
    the text after it continues from its largest position plus one, as verl's get_rope_index (and vLLM's) have it;
    transformers 5.19 continues from start + max(h, w) instead."""
    qwen2_vl = verl_module("verl.models.transformers.qwen2_vl")
    ids = [5, 6, VISION_START, *[IMAGE] * 4, 7, VISION_START, *[VIDEO] * 3, 8, 9]
    images, videos = torch.tensor([[1, 4, 4]]), torch.tensor([[3, 2, 2]])
    tokens = {"<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO, "<|vision_start|>": VISION_START}
    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2),
                                tokenizer=SimpleNamespace(convert_tokens_to_ids=tokens.__getitem__))
    row = torch.tensor(ids)
    expected = qwen2_vl.get_rope_index(processor, row, image_grid_thw=images, video_grid_thw=videos,
                                       second_per_grid_ts=torch.tensor([seconds]))
    rows = [{"pixel_values": torch.zeros(16, 1), "image_grid_thw": images, "pixel_values_videos": torch.zeros(12, 1),
             "video_grid_thw": videos, "second_per_grid_ts": torch.tensor([seconds])}]
    config = _tiny_config()
    config["vision_config"]["tokens_per_second"] = 2  # the released models' (verl's get_rope_index assumes it)
    ours, _ = model_inputs(parse_hf_config(config), row[None], torch.ones(1, len(ids), dtype=torch.long), rows)
    assert torch.equal(ours[:, 0], expected)


def test_image_inputs_that_do_not_match_the_tokens_are_refused():
    hf = parse_hf_config(_tiny_config())
    input_ids, attention_mask, images = visual_text_batch()
    with pytest.raises(ValueError, match=r"row 2: its images need 7 image tokens \(id 150\), the row has 0"):
        model_inputs(hf, input_ids, attention_mask, [images[0], images[1], images[1]])
    with pytest.raises(ValueError, match=r"row 1: image of grid \[1, 4, 6\] needs 6 image tokens, the sequence has 5 there"):
        model_inputs(hf, input_ids, attention_mask, [images[0], {k: v.flip(0) for k, v in images[1].items()}, None])
    text_fields = {k: v for k, v in RELEASED_7B.items() if k not in ("vision_config", "rope_scaling")}
    text = parse_hf_config({**text_fields, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"})
    with pytest.raises(ValueError, match="is a text model; the batch has images or videos"):
        model_inputs(text, input_ids, attention_mask, images)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    directory = str(make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl") / "tiny"))
    results = run_multiprocess(layout_checks, 2, directory, LAYOUTS, timeout_s=900)
    return directory, results, hf_reference(directory)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp, sp", LAYOUTS)
def test_logits_match_transformers(setup, tp, pp, sp):
    _, results, (expected, _) = setup
    assert_logits_match(results, expected, visual_text_batch()[1].bool(), (tp, pp, sp), TOLERANCE)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True)])
def test_gradients_match_transformers(setup, tp, sp):
    _, results, (_, expected) = setup
    assert_grads_match(results, {name: expected[name] for name in GRAD_PARAMS}, (tp, sp))


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_export_round_trip_is_exact(setup, tp, pp):
    directory, results, _ = setup
    assert_export_exact(load_file(Path(directory) / "model.safetensors"), dict(results[0]["export"][tp, pp]))
