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
    args = translate([f"actor_rollout_ref.model.use_remove_padding={value}", f"critic.model.use_remove_padding={value}"],
                     with_verl_defaults=False)
    cfg = load_config(overrides=[*SIZES, *args])
    validate(cfg)
    for role in (cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref, cfg.critic):
        assert role.megatron.packed_sequences is packed


def test_model_engine_megatron_and_a_null_py_executable_are_taken():
    args = translate(["model_engine=megatron", "ray_kwargs.ray_init.runtime_env.py_executable=null"],
                     with_verl_defaults=False)
    assert args == []


@pytest.mark.parametrize("arg, message", [
    ("model_engine=fsdp", "model_engine=fsdp: megatron-rl trains with Megatron-Core only"),
    ("ray_kwargs.ray_init.runtime_env.py_executable=uv -v run --frozen --all-packages --extra vllm --extra megatron",
     "py_executable=uv -v run .*: megatron-rl's Ray workers run the driver's Python"),
])
def test_what_cannot_be_honoured_is_refused_with_the_reason(arg, message):
    with pytest.raises(ConfigError, match=message):
        translate([arg])


def test_policy_loss_loss_mode_and_its_parameters_sit_next_to_the_name():
    args = translate(["actor_rollout_ref.actor.policy_loss.loss_mode=dro",
                      "actor_rollout_ref.actor.policy_loss.dro_beta=0.05"], with_verl_defaults=False)
    assert args == ["actor_rollout_ref.actor.policy_loss=dro", "actor_rollout_ref.actor.dro_beta=0.05"]
    cfg = load_config(overrides=[*SIZES, *args])
    validate(cfg)
    from megatron_rl.algos.policy_loss import PolicyLossConfig

    assert PolicyLossConfig.from_actor_config(cfg.actor_rollout_ref.actor).dro_beta == 0.05


def _log_prob_spec(model_dir: str, rollout: dict) -> tuple:
    from megatron_rl.config.schema import ActorConfig
    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.workers import ActorRole, MegatronEngine

    init_model_parallel()
    config = ActorConfig(ppo_mini_batch_size=2, use_dynamic_bsz=False, ppo_max_token_len_per_gpu=999)
    actor = ActorRole(MegatronEngine(model_dir, config.megatron, config.optim), config, rollout_n=2, **rollout)
    destroy_model_parallel()
    spec = actor.log_prob_spec
    return spec.use_dynamic_bsz, spec.max_token_len, actor.log_prob_budget_key


def test_rollout_log_prob_budget_drives_the_old_log_prob_pass(tmp_path):
    """rollout.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu (verl's keys) set compute_log_prob's
    micro-batching; unset, the actor's training budget does (verl's default interpolation)."""
    from megatron_rl.distributed import run_multiprocess
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    model = str(make_tiny_hf_checkpoint(tmp_path / "m", "qwen2", with_tokenizer=False))
    given = run_multiprocess(_log_prob_spec, 1, model, {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len": 64},
                             timeout_s=300)[0]
    assert given == (True, 64, "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")
    default = run_multiprocess(_log_prob_spec, 1, model, {}, timeout_s=300)[0]
    assert default == (False, 999, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu")


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.policy_loss=dro"], r"policy_loss=dro needs actor_rollout_ref.actor.dro_beta > 0"),
    (["actor_rollout_ref.actor.policy_loss=dro", "actor_rollout_ref.actor.dro_beta=0"], r"dro_beta > 0 .* got 0"),
    (["actor_rollout_ref.actor.clip_cov_ratio=2"], r"clip_cov_ratio=2.0 must be in \(0, 1\]"),
])
def test_loss_parameters_are_checked_before_launch(overrides, message):
    """Before, dro without dro_beta failed in the first update, after Ray and the workers had started."""
    with pytest.raises(ConfigError, match=message):
        validate(load_config(overrides=[*SIZES, *overrides]))
