"""Keys of verl's own CI script (tests/special_e2e/run_ppo_trainer_megatron.sh, recorded in
tests/compat/verl_scripts/special_e2e_ppo_trainer_megatron_vllm.args) that were refused though they say nothing or have
a meaning here: settings of a profiler that is off, a Megatron checkpoint path with use_dist_checkpointing off, a LoRA
block with rank 0, lr_warmup_steps=null, Megatron's own defaults of CPU-Adam companions, checkpoint save_contents,
verl's newer reward.reward_model layout, use_remove_padding=False under CP. Each is accepted with what it means, and
refused where it would mean something not built."""
from __future__ import annotations

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate_with_notes
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate

A = "actor_rollout_ref.actor"


def _overrides(*args: str) -> list[str]:
    return translate_with_notes(list(args), with_verl_defaults=False).overrides


@pytest.mark.parametrize("args, expected", [
    ((f"{A}.profiler.enable=False", f"{A}.profiler.ranks=[0,1,2,3]", "global_profiler.tool=nsys",
      "global_profiler.steps=[1]"), []),
    ((f"{A}.megatron.use_dist_checkpointing=False", f"{A}.megatron.dist_checkpointing_path=/ckpt/m"), []),
    (("actor_rollout_ref.model.lora.rank=0", "actor_rollout_ref.model.lora.alpha=0",
      "actor_rollout_ref.model.lora.merge=False", "+actor_rollout_ref.model.lora.fully_sharded_loras=True"),
     ["actor_rollout_ref.model.lora.rank=0"]),
    (("actor_rollout_ref.model.lora.rank=8", "+actor_rollout_ref.model.lora.fully_sharded_loras=True",
      "actor_rollout_ref.model.lora.alpha=16"),
     ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16"]),
    ((f"{A}.optim.lr_warmup_steps=null",), [f"{A}.optim.lr_warmup_steps=0"]),
    ((f"{A}.optim.lr_warmup_steps=-1",), [f"{A}.optim.lr_warmup_steps=0"]),
    ((f"{A}.optim.lr_warmup_steps=5",), [f"{A}.optim.lr_warmup_steps=5"]),
    ((f"{A}.checkpoint.save_contents=[model,optimizer,extra]",), []),
    ((f"{A}.checkpoint.save_contents=[model,hf_model,optimizer,extra]",), ["trainer.save_hf_at_end=true"]),
    (("reward.reward_model.enable=True", "reward.reward_model.model_path=/m/rm",
      "reward.reward_model.rollout.name=vllm", "reward.reward_model.rollout.prompt_length=1024",
      "reward.reward_model.rollout.response_length=512"),
     ["reward_model.enable=True", "reward_model.model.path=/m/rm", "reward_model.max_length=1536",
      "reward_model.max_length=1536"]),
    (("actor_rollout_ref.model.use_remove_padding=False", f"{A}.megatron.context_parallel_size=2"),
     [f"{A}.megatron.packed_sequences=true", "actor_rollout_ref.ref.megatron.packed_sequences=true",
      f"{A}.megatron.context_parallel_size=2"]),
    (("actor_rollout_ref.model.trust_remote_code=True",), ["data.trust_remote_code=true"]),
    (("actor_rollout_ref.model.trust_remote_code=False",), []),
    (("actor_rollout_ref.model.use_remove_padding=False",),
     [f"{A}.megatron.packed_sequences=false", "actor_rollout_ref.ref.megatron.packed_sequences=false"]),
])
def test_accepted_with_their_meaning(args, expected):
    assert _overrides(*args) == expected


@pytest.mark.parametrize("args, message", [
    ((f"{A}.profiler.ranks=[0]", f"{A}.profiler.enable=True"),
     r"profiler.ranks=\[0\]: no built-in profiler hooks here.*\(actor_rollout_ref.actor.profiler.enable=True\)"),
    ((f"{A}.megatron.dist_checkpointing_path=/ckpt/m", f"{A}.megatron.use_dist_checkpointing=True"),
     r"dist_checkpointing_path=/ckpt/m: with .*use_dist_checkpointing=True verl starts from that Megatron checkpoint"),
    ((f"{A}.optim.lr_warmup_steps=null", f"{A}.optim.lr_warmup_steps_ratio=0.1"),
     r"lr_warmup_steps=null: verl would warm up for .*lr_warmup_steps_ratio=0.1 of the steps"),
    ((f"{A}.checkpoint.save_contents=[model,weights]",), r"save_contents=\[model,weights\]: weights unknown"),
])
def test_refused_where_they_would_mean_something_not_built(args, message):
    with pytest.raises(ConfigError, match=message):
        _overrides(*args)


def test_megatron_defaults_of_cpu_adam_companions_say_nothing():
    """verl's CI script writes overlap_cpu_optimizer_d2h_h2d=False (Megatron's default) without CPU offload: accepted;
    True without offload still refused."""
    base = ["data.train_files=[/d/train.parquet]", "actor_rollout_ref.model.path=/m", "trainer.device=cpu"]
    off = f"++{A}.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d"
    validate(load_config(overrides=[*base, f"{off}=false"]))
    with pytest.raises(ConfigError, match="overlap_cpu_optimizer_d2h_h2d=True has no effect without"):
        validate(load_config(overrides=[*base, f"{off}=true"]))
