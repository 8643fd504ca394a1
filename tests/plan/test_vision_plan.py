"""The planner counts a vision-language model's vision tower (plan/vision.py): Qwen2.5-VL-7B's parameters equal the
released checkpoint's (8,292,166,656, the tower 676,550,144), Qwen3-VL-8B's too (8,767,123,696, the tower with its
DeepStack mergers 576,388,336), the tower sits whole on every TP rank of the first
stage, travels in the weight sync, has its activations in the actor's update (none when frozen); and what is not
built for a vision-language model is refused before launch, naming the key."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate
from megatron_rl.config import load_config
from megatron_rl.models.hf_config import parse_hf_config
from megatron_rl.models.vision_model import vision_tensor_shapes
from megatron_rl.plan import PlanError, build_plan, memory
from megatron_rl.plan.memory import Layout
from megatron_rl.plan.planner import _plan, check_launch
from megatron_rl.plan.traffic import model_sync_traffic, shard_groups
from megatron_rl.plan.vision import (
    VERL_DEFAULT_MAX_PIXELS,
    max_pixels,
    patches_per_sample,
    vision_params,
)
from megatron_rl_testing.vl_configs import (
    QWEN2_5_VL_7B,
    QWEN2_5_VL_7B_PARAMS,
    QWEN2_5_VL_7B_VISION_PARAMS,
    QWEN3_VL_8B,
    QWEN3_VL_8B_PARAMS,
    QWEN3_VL_8B_VISION_PARAMS,
)
from megatron_rl_testing.vl_models import tiny_qwen2_5_vl_config, tiny_qwen3_vl_config

SCRIPT = Path(__file__).parents[1] / "compat" / "verl_scripts" / "vision" / "qwen2_5_vl_7b.args"
FITS = ["+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1",
        "actor_rollout_ref.actor.megatron.param_offload=True", "actor_rollout_ref.actor.megatron.optimizer_offload=True"]


def qwen2_5_vl_7b():
    return parse_hf_config(QWEN2_5_VL_7B)


def test_qwen2_5_vl_7b_parameters_are_the_released_checkpoints():
    model = qwen2_5_vl_7b()
    assert abs(memory.numel(model) / QWEN2_5_VL_7B_PARAMS - 1) < 0.01  # (exact: 8,292,166,656)
    assert memory.numel(model) == QWEN2_5_VL_7B_PARAMS
    assert abs(vision_params(model.vision) / 0.676e9 - 1) < 0.01
    assert vision_params(model.vision) == QWEN2_5_VL_7B_VISION_PARAMS
    text = dataclasses.replace(model, vision=None)
    assert memory.total_params(model) - memory.total_params(text) == QWEN2_5_VL_7B_VISION_PARAMS


def test_qwen3_vl_8b_parameters_are_the_released_checkpoints():
    model = parse_hf_config(QWEN3_VL_8B)
    assert abs(memory.numel(model) / 8.77e9 - 1) < 0.001  # the released 8.77 B
    assert memory.numel(model) == QWEN3_VL_8B_PARAMS
    assert vision_params(model.vision) == QWEN3_VL_8B_VISION_PARAMS
    text = dataclasses.replace(model, vision=None)
    assert memory.total_params(model) - memory.total_params(text) == QWEN3_VL_8B_VISION_PARAMS


@pytest.mark.parametrize("config", [
    QWEN2_5_VL_7B, {**tiny_qwen2_5_vl_config().to_dict(), "architectures": ["Qwen2_5_VLForConditionalGeneration"]},
    QWEN3_VL_8B, {**tiny_qwen3_vl_config().to_dict(), "architectures": ["Qwen3VLForConditionalGeneration"]},
], ids=["qwen2_5_vl_7b", "qwen2_5_vl_tiny", "qwen3_vl_8b", "qwen3_vl_tiny"])
def test_the_closed_form_counts_the_built_towers_tensors(config):
    spec = parse_hf_config(config).vision
    assert vision_params(spec) == sum(math.prod(shape) for shape in vision_tensor_shapes(spec).values())


def test_the_tower_is_whole_on_every_tp_rank_of_the_first_stage():
    model = qwen2_5_vl_7b()
    text = dataclasses.replace(model, vision=None)
    for tp, pp in ((1, 1), (2, 2), (4, 2)):
        layout = Layout(tp=tp, pp=pp, cp=1, dp=1)
        assert (memory.stage_params(model, layout, "first") - memory.stage_params(text, layout, "first")
                == QWEN2_5_VL_7B_VISION_PARAMS)
        if pp > 1:
            assert memory.stage_params(model, layout, "last") == memory.stage_params(text, layout, "last")
    # the engines hold it too (bf16, split over the engine's TP like the rest)
    assert memory.rollout_weight_bytes(model, 2) - memory.rollout_weight_bytes(text, 2) == (
        QWEN2_5_VL_7B_VISION_PARAMS * 2 / 2)


def test_the_weight_sync_carries_the_vision_tensors():
    model = qwen2_5_vl_7b()
    text = dataclasses.replace(model, vision=None)
    sent = sum(sum(g.hf_bytes) for g in shard_groups(model, 2, 2, 2))
    assert sent == 2 * QWEN2_5_VL_7B_PARAMS
    assert sent - sum(sum(g.hf_bytes) for g in shard_groups(text, 2, 2, 2)) == 2 * QWEN2_5_VL_7B_VISION_PARAMS
    with_tower, without = (model_sync_traffic(m, 2, 2, 2, 8, path="shard_first").worst("copy") for m in (model, text))
    assert with_tower > without


def test_patches_per_sample_from_max_pixels_bounded_by_the_prompt():
    spec = qwen2_5_vl_7b().vision
    assert max_pixels(None) == max_pixels({}) == VERL_DEFAULT_MAX_PIXELS == 16384 * 28 * 28
    assert max_pixels({"max_pixels": 512 * 28 * 28}) == 512 * 28 * 28
    assert patches_per_sample(spec, 512 * 28 * 28, 4096) == 512 * 28 * 28 // 14 ** 2 == 2048
    # verl's default bound allows 65,536 patches; a 1024-token prompt holds 1024 image tokens of 2 x 2 patches
    assert patches_per_sample(spec, VERL_DEFAULT_MAX_PIXELS, 1024) == 4096


def _config(tmp_path: Path, facts: dict, *extra: str, through_compat_with_model: bool = True):
    """The Qwen2.5-VL-7B script's config (compat entry) with ``extra`` megatron-rl overrides after it."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(facts))
    args = [a.replace("Qwen/Qwen2.5-VL-7B-Instruct", str(model) if through_compat_with_model else "Qwen/none")
            .replace("/HOME/data", str(tmp_path / "data")) for a in SCRIPT.read_text().splitlines()]
    return load_config(overrides=translate(args) + [f"actor_rollout_ref.model.path={model}", *extra])


def test_the_plan_counts_the_tower_and_its_activations(tmp_path):
    text = _plan(_config(tmp_path, QWEN2_5_VL_7B, *FITS)).format()  # (it does not fit: the tower's activations)
    assert "Qwen2_5_VLForConditionalGeneration, 8.29 B params" in text, text
    assert "actor vision tower activations (4,096 patches per sample at most)" in text, text
    smaller = _plan(_config(tmp_path, QWEN2_5_VL_7B, *FITS, "++data.mm_processor_kwargs.max_pixels=200704"))
    assert "(1,024 patches per sample at most)" in smaller.format()  # 200,704 = 1024 x 14 x 14


def test_a_frozen_tower_keeps_weights_only(tmp_path):
    plan = build_plan(_config(tmp_path, QWEN2_5_VL_7B, *FITS, "actor_rollout_ref.actor.freeze_vision_tower=true"))
    rows = {row.label: row for row in plan.rows}
    frozen = rows["actor vision tower (bf16, frozen)"]
    assert max(frozen.per_phase.values()) == QWEN2_5_VL_7B_VISION_PARAMS * 2
    assert not [label for label in rows if "vision tower activations" in label]


@pytest.mark.parametrize("extra, message", [
    (("actor_rollout_ref.actor.megatron.context_parallel_size=2", "actor_rollout_ref.actor.megatron.packed_sequences=true",
      "actor_rollout_ref.ref.megatron.packed_sequences=true"),
     r"actor_rollout_ref.actor.megatron.context_parallel_size=2 with a vision-language model"),
    (("actor_rollout_ref.actor.megatron.packed_sequences=true",),
     r"actor_rollout_ref.actor.megatron.packed_sequences=true with a vision-language model"),
])
def test_what_a_vision_language_model_does_not_run_is_refused_by_key(tmp_path, extra, message):
    cfg = _config(tmp_path, QWEN2_5_VL_7B, *FITS, *extra)
    with pytest.raises(PlanError, match=message):
        build_plan(cfg)
    with pytest.raises(PlanError, match=message):
        check_launch(cfg)


def test_qwen3_vl_is_planned_with_its_tower(tmp_path):
    """Qwen3-VL-8B in the Qwen2.5-VL script's place: planned, its tower (DeepStack mergers included) counted."""
    cfg = _config(tmp_path, QWEN3_VL_8B, *FITS)
    text = _plan(cfg).format()
    assert "Qwen3VLForConditionalGeneration, 8.77 B params" in text, text
    assert "actor vision tower activations" in text, text


def test_freeze_vision_tower_on_a_text_model_is_refused_by_key(tmp_path):
    qwen2_5_7b = {k: v for k, v in QWEN2_5_VL_7B.items() if k not in ("vision_config", "rope_scaling")}
    qwen2_5_7b["architectures"] = ["Qwen2ForCausalLM"]
    cfg = _config(tmp_path, qwen2_5_7b, *FITS, "actor_rollout_ref.actor.freeze_vision_tower=true")
    with pytest.raises(PlanError, match=r"actor_rollout_ref.actor.freeze_vision_tower=true, but Qwen2ForCausalLM has "
                                        r"no vision tower"):
        build_plan(cfg)
