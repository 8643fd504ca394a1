"""Issue 56 item 5: one of megatron-rl's presets through the verl entry keeps its values. Hydra applies command-line
values after a preset, and the entry used to put verl's defaults on the command line: with ``+experiment=grpo_tiny_cpu``
the run trained GAE with a critic (``algorithm.adv_estimator=gae``), one response per prompt instead of the preset's 8,
with verl's packed sequences beside the preset's shared prompts (refused by validation), and the only sign was one line
among thirty notes. Now a preset gets none of verl's defaults, says so in one line, and the user's own arguments still
win over the preset."""
from __future__ import annotations

import pytest

from megatron_rl.compat.verl.experimental.one_step_off_policy.main_ppo import translate_with_notes as one_step_off
from megatron_rl.compat.verl.trainer.main_ppo import translate, translate_with_notes
from megatron_rl.config import load_config
from megatron_rl.plan.validate import validate

PRESET = "+experiment=grpo_tiny_cpu"
PATHS = ("data.train_files=[/data/train.parquet]", "actor_rollout_ref.model.path=/models/tiny")


def test_the_presets_values_stand_and_the_entry_says_why():
    cfg = load_config(overrides=translate([PRESET, *PATHS]))
    assert cfg.algorithm.adv_estimator == "grpo"  # verl's default: gae (a critic)
    assert cfg.actor_rollout_ref.rollout.n == 8  # verl's default: 1
    assert cfg.trainer.device == "cpu"  # verl's default: cuda
    assert cfg.actor_rollout_ref.actor.megatron.share_prompts
    assert not cfg.actor_rollout_ref.actor.megatron.packed_sequences  # verl's: true, refused beside shared prompts
    validate(cfg)
    notes = translate_with_notes([PRESET, *PATHS]).notes
    assert not [n for n in notes if n.startswith("verl default")], notes
    assert any(n.startswith("+experiment=grpo_tiny_cpu: the preset's values and megatron-rl's defaults stand; "
                            "verl's defaults are not applied") for n in notes), notes


def test_the_users_arguments_still_win_over_the_preset():
    cfg = load_config(overrides=translate([PRESET, *PATHS, "algorithm.adv_estimator=rloo",
                                           "actor_rollout_ref.rollout.n=4"]))
    assert (cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n) == ("rloo", 4)


def test_the_async_entries_keep_the_preset_too():
    overrides = one_step_off(["--config-name=one_step_off_ppo_megatron_trainer.yaml", PRESET, *PATHS]).overrides
    cfg = load_config(overrides=overrides)
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.actor_rollout_ref.rollout.n == 8


@pytest.mark.parametrize("args", [[*PATHS], [*PATHS, "trainer.device=cpu"]])
def test_without_a_preset_verls_defaults_apply_as_before(args):
    cfg = load_config(overrides=translate(args))
    assert cfg.algorithm.adv_estimator == "gae" and cfg.actor_rollout_ref.rollout.n == 1
    assert cfg.actor_rollout_ref.actor.megatron.packed_sequences
