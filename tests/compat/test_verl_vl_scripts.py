"""verl's vision-language Megatron example scripts (verl-project/verl at 1dda039b9, recorded with a stub python3 as
tests/compat/test_verl_current_scripts.py records its scripts: VERL_USE_UV=0, HOME=/HOME, RAY_DATA_HOME=/HOME;
tests/compat/verl_scripts/vision/*.args) through the verl entry with the released config.json facts of the models
they name (megatron_rl_testing/vl_configs.py):

- grpo_trainer/run_qwen2_5_vl_7b_megatron.sh: composes, validates and plans. Its use_remove_padding=True (packed THD
  here) becomes padded micro-batches for a vision-language model, with one logged line naming the key; the plan
  counts the vision tower (8.29 B parameters, 0.68 B of them the tower) and its activations. At the script's
  defaults (no recompute, 24k-token micro-batches, the tower's activations whole on every TP rank) our count says
  it does not fit an 80 GB GPU; with recompute, offload and the tower frozen it fits.
- run_qwen3_vl_8b_megatron.sh: composes, validates and plans as the Qwen2.5-VL script does (Qwen3-VL's interleaved
  mRoPE and DeepStack are built, models/vision_model.py): 8.77 B parameters, the tower with its DeepStack mergers
  counted; at the script's defaults it does not fit an 80 GB GPU, with recompute, offload and the tower frozen it does.
- run_qwen3_vl_30b_a3b_megatron.sh, run_qwen3_vl_235b_a22b_megatron.sh: refused by architecture
  (Qwen3VLMoeForConditionalGeneration, models/unbuilt.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.compat.verl.keys import Fate, fate_of
from megatron_rl.compat.verl.trainer.main_ppo import translate, translate_with_notes
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan import PlanError, build_plan
from megatron_rl.plan.validate import validate
from megatron_rl_testing.vl_configs import QWEN2_5_VL_7B, QWEN3_VL_8B, QWEN3_VL_30B_A3B, QWEN3_VL_235B_A22B

SCRIPTS = Path(__file__).with_name("verl_scripts") / "vision"
MODELS = {"qwen2_5_vl_7b": QWEN2_5_VL_7B, "qwen3_vl_8b": QWEN3_VL_8B, "qwen3_vl_30b_a3b": QWEN3_VL_30B_A3B,
          "qwen3_vl_235b_a22b": QWEN3_VL_235B_A22B}
REMOVE_PADDING = "actor_rollout_ref.model.use_remove_padding"
FITS = ["+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1",
        "actor_rollout_ref.actor.megatron.param_offload=True", "actor_rollout_ref.actor.megatron.optimizer_offload=True",
        "actor_rollout_ref.actor.freeze_vision_tower=True"]


def recorded(name: str) -> list[str]:
    return (SCRIPTS / f"{name}.args").read_text().splitlines()


def script_args(name: str, tmp_path: Path, facts: dict | None = None) -> list[str]:
    """The script's arguments with its model replaced by a directory holding the model's config.json."""
    args = recorded(name)
    model = next(a.split("=", 1)[1] for a in args if a.startswith("actor_rollout_ref.model.path="))
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(facts or MODELS[name]))
    return [a.replace(model, str(tmp_path / "model")).replace("/HOME/data", str(tmp_path / "data")) for a in args]


def test_the_recorded_scripts_are_here():
    assert sorted(p.stem for p in SCRIPTS.glob("*.args")) == sorted(MODELS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_key_of_the_scripts_is_known(name):
    """Each key has a fate in the compat table (none refused), and without the model at hand (preflight reads it on
    the nodes) every argument translates."""
    for arg in recorded(name):
        key = arg.split("=", 1)[0].lstrip("+~")
        assert fate_of(key)[0] is not Fate.refused, key
    translate(recorded(name))


def test_qwen2_5_vl_7b_composes_validates_and_plans_unpacked(tmp_path):
    args = script_args("qwen2_5_vl_7b", tmp_path)
    translation = translate_with_notes(args)
    named = [n for n in translation.notes if REMOVE_PADDING in n]
    assert len(named) == 1 and "vision-language model" in named[0] and "runs unpacked" in named[0], named
    cfg = load_config(overrides=translation.overrides)
    arr = cfg.actor_rollout_ref
    assert not arr.actor.megatron.packed_sequences and not arr.ref.megatron.packed_sequences
    assert (cfg.data.image_key, arr.actor.megatron.tensor_model_parallel_size,
            arr.actor.megatron.pipeline_model_parallel_size, arr.rollout.name) == ("images", 2, 2, "vllm")
    assert arr.actor.freeze_vision_tower is False  # verl's default
    validate(cfg)
    with pytest.raises(PlanError) as err:  # its defaults: no recompute, 24k-token micro-batches
        build_plan(cfg)
    text = str(err.value)
    assert "Qwen2_5_VLForConditionalGeneration, 8.29 B params" in text, text
    assert "actor vision tower activations (4,096 patches per sample at most)" in text, text
    assert "DOES NOT FIT" in text and "recompute_granularity=full" in text, text


def test_qwen2_5_vl_7b_fits_with_recompute_offload_and_the_tower_frozen(tmp_path):
    cfg = load_config(overrides=translate(script_args("qwen2_5_vl_7b", tmp_path) + FITS))
    validate(cfg)
    text = build_plan(cfg).format()
    assert "actor vision tower (bf16, frozen)" in text and "vision tower activations" not in text, text
    assert "of 79.6 GiB per GPU: fits" in text, text


def test_use_remove_padding_false_needs_no_note(tmp_path):
    args = [a.replace(f"{REMOVE_PADDING}=True", f"{REMOVE_PADDING}=False") for a in script_args("qwen2_5_vl_7b",
                                                                                                tmp_path)]
    translation = translate_with_notes(args)
    assert not [n for n in translation.notes if "runs unpacked" in n]
    cfg = load_config(overrides=translation.overrides)
    assert not cfg.actor_rollout_ref.actor.megatron.packed_sequences and not cfg.critic.megatron.packed_sequences


def test_context_parallel_with_a_vision_language_model_is_refused_by_key(tmp_path):
    args = script_args("qwen2_5_vl_7b", tmp_path) + ["actor_rollout_ref.actor.megatron.context_parallel_size=2"]
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron.context_parallel_size=2 with a "
                                          r"vision-language model \(Qwen2_5_VLForConditionalGeneration\): context "
                                          r"parallelism is not built for it"):
        translate(args)


def test_qwen3_vl_8b_composes_validates_and_plans_unpacked(tmp_path):
    translation = translate_with_notes(script_args("qwen3_vl_8b", tmp_path))
    named = [n for n in translation.notes if REMOVE_PADDING in n]
    assert len(named) == 1 and "Qwen3VLForConditionalGeneration is a vision-language model" in named[0], named
    cfg = load_config(overrides=translation.overrides)
    arr = cfg.actor_rollout_ref
    assert not arr.actor.megatron.packed_sequences and not arr.ref.megatron.packed_sequences
    assert (arr.actor.megatron.tensor_model_parallel_size, arr.actor.megatron.pipeline_model_parallel_size,
            arr.rollout.name) == (2, 2, "vllm")
    validate(cfg)
    with pytest.raises(PlanError) as err:  # its defaults: no recompute, 24k-token micro-batches
        build_plan(cfg)
    text = str(err.value)
    assert "Qwen3VLForConditionalGeneration, 8.77 B params" in text, text
    assert "actor vision tower activations (4,096 patches per sample at most)" in text, text
    assert "DOES NOT FIT" in text, text


def test_qwen3_vl_8b_fits_with_recompute_offload_and_the_tower_frozen(tmp_path):
    cfg = load_config(overrides=translate(script_args("qwen3_vl_8b", tmp_path) + FITS))
    validate(cfg)
    text = build_plan(cfg).format()
    assert "actor vision tower (bf16, frozen)" in text and "of 79.6 GiB per GPU: fits" in text, text


@pytest.mark.parametrize("name", ["qwen3_vl_30b_a3b", "qwen3_vl_235b_a22b"])
def test_qwen3_vl_moe_is_refused_by_architecture(name, tmp_path):
    with pytest.raises(ConfigError, match=r"architecture Qwen3VLMoeForConditionalGeneration is not supported: a "
                                          r"mixture-of-experts vision-language model.*DeepStack.*interleaved mRoPE"):
        translate(script_args(name, tmp_path))
