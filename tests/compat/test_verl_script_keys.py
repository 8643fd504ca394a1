"""Keys of verl's current Megatron example scripts (verl-project/verl at 1dda039b9,
examples/grpo_trainer/run_qwen3_8b_megatron.sh) through megatron_rl.compat.verl.trainer.main_ppo (issue 37): each
honoured, mapped onto what does the same here, or refused with the reason. Before, each failed Hydra's struct
check as an unknown key."""
from __future__ import annotations

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate

SIZES = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
         "trainer.device=cpu"]


@pytest.mark.parametrize("value, packed", [("True", True), ("False", False)])
def test_use_remove_padding_is_the_packed_layout(value, packed):
    args = translate([f"actor_rollout_ref.model.use_remove_padding={value}", f"critic.model.use_remove_padding={value}"])
    cfg = load_config(overrides=[*SIZES, *args])
    validate(cfg)
    for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref, cfg.critic):
        assert role.megatron.packed_sequences is packed


def test_model_engine_megatron_and_a_null_py_executable_are_taken():
    args = translate(["model_engine=megatron", "ray_kwargs.ray_init.runtime_env.py_executable=null"])
    assert args == []


@pytest.mark.parametrize("arg, message", [
    ("model_engine=fsdp", "model_engine=fsdp: megatron-rl trains with Megatron-Core only"),
    ("ray_kwargs.ray_init.runtime_env.py_executable=uv -v run --frozen --all-packages --extra vllm --extra megatron",
     "py_executable=uv -v run .*: megatron-rl's Ray workers run the driver's Python"),
])
def test_what_cannot_be_honoured_is_refused_with_the_reason(arg, message):
    with pytest.raises(ConfigError, match=message):
        translate([arg])
