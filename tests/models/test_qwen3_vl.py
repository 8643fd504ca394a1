"""Qwen3-VL (dense) on Megatron-Core against transformers: the config read (a Qwen3 language model with interleaved
mRoPE, DeepStack, checkpoint names under ``model.language_model.`` / ``model.visual.``), the interleaved frequency
layout and the mRoPE positions equal to transformers', and on an image+video+text batch (three rows, left/right/both
padding, two images and a video of two timestamped temporal patches in one row, a text-only row) the logits (fp32, within 1e-5), the gradients of the vision tower
(DeepStack mergers included) and of language-model norms (also under full activation recompute), and the exact export
round trip, at TP 1/2 (with and without sequence parallelism) and PP 2 on 2 gloo ranks; DeepStack into more layers
than the first pipeline stage holds is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import parse_hf_config
from megatron_rl.models.mrope import interleaved_mrope_axes
from megatron_rl.models.vision_inputs import collate_visual_inputs, model_inputs
from megatron_rl_testing.vl_configs import QWEN3_VL_8B
from megatron_rl_testing.vl_models import VIDEO, make_tiny_qwen3_vl, mm_token_types, tiny_qwen3_vl_config
from qwen3_vl_jobs import GRAD_PARAMS, batch, hf_reference, layout_checks
from vision_jobs import assert_export_exact, assert_grads_match, assert_logits_match

TOLERANCE = 1e-5
LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]


def test_released_8b_and_tiny_configs_read_a_qwen3_language_model_with_interleaved_mrope():
    released = parse_hf_config(QWEN3_VL_8B)
    assert (released.architecture, released.model_type, released.qkv_bias, released.qk_norm) == (
        "Qwen3VLForConditionalGeneration", "qwen3", False, True)
    assert (released.num_layers, released.hidden_size, released.head_dim, released.rope_theta) == (36, 4096, 128, 5e6)
    spec = released.vision
    assert (spec.family, spec.mrope_section, spec.mrope_interleaved, spec.deepstack_visual_indexes) == (
        "qwen3_vl", (24, 20, 20), True, (8, 16, 24))
    assert (spec.vision_prefix, spec.language_prefix, spec.patch_size, spec.out_hidden_size) == (
        "model.visual.", "model.language_model.", 16, 4096)
    tiny = parse_hf_config({**tiny_qwen3_vl_config().to_dict(), "architectures": ["Qwen3VLForConditionalGeneration"]})
    assert (tiny.num_layers, tiny.head_dim, tiny.qk_norm, tiny.vision.mrope_section) == (4, 32, True, (6, 6, 4))
    assert tiny.vision.mrope_interleaved and tiny.vision.deepstack_visual_indexes == (0, 1)


@pytest.mark.parametrize("section, pairs", [((24, 20, 20), 64), ((6, 6, 4), 16), ((2, 3, 3), 8)])
def test_interleaved_mrope_axes_are_transformers_frequency_layout(section, pairs):
    """transformers' Qwen3VLTextRotaryEmbedding.recomposition_frequencies on frequencies that are their axis's
    number picks, per pair, the axis our rotary turns it by."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    rotary = Qwen3VLTextRotaryEmbedding.__new__(Qwen3VLTextRotaryEmbedding)
    rotary.mrope_section = list(section)
    by_axis = torch.arange(3.0)[:, None, None, None].expand(3, 1, 1, pairs).clone()
    expected = rotary.recomposition_frequencies(by_axis)[0, 0, :pairs].long()
    axes = interleaved_mrope_axes(section, pairs)
    assert torch.equal(axes, expected)
    sectioned = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    assert not torch.equal(axes, sectioned)  # not Megatron-Core's sectioned layout


def test_mrope_positions_equal_transformers_get_rope_index():
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config())
    input_ids, attention_mask, rows = batch()
    visual = collate_visual_inputs(rows)
    expected, _ = model.model.get_rope_index(input_ids, mm_token_types(input_ids), image_grid_thw=visual["image_grid_thw"],
                                             video_grid_thw=visual["video_grid_thw"], attention_mask=attention_mask)
    hf = parse_hf_config({**tiny_qwen3_vl_config().to_dict(), "architectures": ["Qwen3VLForConditionalGeneration"]})
    ours, _ = model_inputs(hf, input_ids, attention_mask, rows)
    valid = attention_mask.bool()
    assert torch.equal(ours[:, valid], expected[:, valid])
    # each temporal patch of the video is its own block (t = 1) behind its timestamp: one temporal position a block
    temporal = ours[0, 1][input_ids[1] == VIDEO].tolist()
    assert temporal == [temporal[0]] * 4 + [temporal[4]] * 4 and temporal[4] > temporal[0] + 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_vl")
    directory = str(make_tiny_qwen3_vl(root / "tiny"))
    refused = str(make_tiny_qwen3_vl(root / "deepstack3", deepstack=(0, 1, 2)))
    results = run_multiprocess(layout_checks, 2, directory, LAYOUTS, refused, timeout_s=900)
    return directory, results, hf_reference(directory)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp, sp", LAYOUTS)
def test_logits_match_transformers(setup, tp, pp, sp):
    _, results, (expected, _) = setup
    assert_logits_match(results, expected, batch()[1].bool(), (tp, pp, sp), TOLERANCE)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [(1, False), (2, False), (2, True), "recompute"])
def test_gradients_match_transformers(setup, layout):
    """The vision tower's (DeepStack mergers and the learned position grid included) and language norms'; at TP 1
    also under full activation recompute, where the DeepStack features ride through Megatron's checkpoints."""
    _, results, (_, expected) = setup
    assert_grads_match(results, {name: expected[name] for name in GRAD_PARAMS}, layout)


@pytest.mark.distributed
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_export_round_trip_is_exact(setup, tp, pp):
    """In the checkpoint's names, which are also transformers' Qwen3VLForConditionalGeneration parameter names (what
    the HF rollout engine loads)."""
    from transformers import Qwen3VLForConditionalGeneration

    directory, results, _ = setup
    exported = dict(results[0]["export"][tp, pp])
    assert_export_exact(load_file(Path(directory) / "model.safetensors"), exported)
    assert set(exported) == set(Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config()).state_dict())


@pytest.mark.distributed
def test_deepstack_past_the_first_pipeline_stage_is_refused(setup):
    _, results, _ = setup
    message = results[0]["refused"]
    assert message is not None and "DeepStack adds vision features (blocks [0, 1, 2]) after language layers 0..2" \
        in message and "holds 2 language layers (0..1)" in message, message
