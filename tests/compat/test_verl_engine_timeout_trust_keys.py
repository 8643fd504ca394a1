"""Three keys of verl's current example scripts (verl-project/verl at 1dda039b9; issue 51) through
megatron_rl.compat.verl.trainer.main_ppo. Before, actor_rollout_ref.actor.model_engine was an unknown key,
actor_rollout_ref.nccl_timeout=7200 was refused as "only verl's default (600) is accepted" and
data.trust_remote_code=True likewise:

- actor_rollout_ref.actor.model_engine (router_replay/run_qwen3_30b_a3b_megatron.sh,
  tuning/scaling/run_qwen2_5_32b_megatron.sh) follows the top-level model_engine: megatron only;
- actor_rollout_ref.nccl_timeout (grpo_trainer/run_qwen3_235b_a22b_megatron.sh) and critic.nccl_timeout, the
  collective timeout in seconds, become ray_init.collective_timeout_s, the timeout of the workers' process groups
  (before it, ray_init.timeout_s: the driver's deadline, while the groups kept Megatron's 10 minutes);
- data.trust_remote_code (the Moonlight and MiMo scripts) is honoured: the tokenizer loads with it, and says so."""
from __future__ import annotations

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate, translate_with_notes
from megatron_rl.config import ConfigError, load_config


def test_the_actors_model_engine_megatron_is_taken_as_the_top_level_one():
    result = translate_with_notes(["actor_rollout_ref.actor.model_engine=megatron"], with_verl_defaults=False)
    assert result.overrides == []
    assert any(n.startswith("verl key actor_rollout_ref.actor.model_engine=megatron -> (nothing)")
               for n in result.notes)


def test_another_engine_on_the_actor_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.model_engine=fsdp: megatron-rl trains with "
                                          "Megatron-Core only; set actor_rollout_ref.actor.model_engine=megatron"):
        translate(["actor_rollout_ref.actor.model_engine=fsdp"])


def test_nccl_timeout_becomes_the_workers_collective_timeout_and_is_logged():
    result = translate_with_notes(["actor_rollout_ref.nccl_timeout=7200"], with_verl_defaults=False)
    assert result.overrides == ["ray_init.collective_timeout_s=7200.0"]
    assert any("actor_rollout_ref.nccl_timeout=7200 -> ray_init.collective_timeout_s=7200.0" in n
               for n in result.notes)
    assert load_config(overrides=result.overrides).ray_init.collective_timeout_s == 7200


def test_the_longer_of_the_actors_and_the_critics_nccl_timeout_wins():
    args = translate(["actor_rollout_ref.nccl_timeout=7200", "critic.nccl_timeout=9600"], with_verl_defaults=False)
    assert load_config(overrides=args).ray_init.collective_timeout_s == 9600


@pytest.mark.parametrize("args, message", [
    (["actor_rollout_ref.nccl_timeout=0"], "actor_rollout_ref.nccl_timeout=0: a timeout is a positive number"),
    (["actor_rollout_ref.nccl_timeout=long"], "actor_rollout_ref.nccl_timeout=long: a timeout is a positive"),
    (["critic.nccl_timeout=-5"], "critic.nccl_timeout=-5: a timeout is a positive number"),
    (["actor_rollout_ref.nccl_timeout=7200", "ray_init.collective_timeout_s=900"],
     "actor_rollout_ref.nccl_timeout=7200 and ray_init.collective_timeout_s=900 both set"),
])
def test_bad_nccl_timeouts_are_refused_naming_the_key(args, message):
    with pytest.raises(ConfigError, match=message):
        translate(args)


def test_data_trust_remote_code_is_honoured_and_false_by_default():
    assert load_config(overrides=translate([])).data.trust_remote_code is False
    cfg = load_config(overrides=translate(["data.trust_remote_code=True"]))
    assert cfg.data.trust_remote_code is True


def test_model_trust_remote_code_means_the_tokenizers_through_the_verl_entry():
    """verl's model.trust_remote_code lets the tokenizer run its shipped code (verl/workers/config/model.py builds the
    tokenizer with it; Moonlight's script sets it): through the entry it becomes data.trust_remote_code; the model is
    built from config.json whatever it says. In megatron-rl's own config the model key stays refused."""
    from megatron_rl.config.checks import check_verl_values

    cfg = load_config(overrides=translate(["actor_rollout_ref.model.trust_remote_code=True"]))
    assert cfg.data.trust_remote_code and not cfg.actor_rollout_ref.model.trust_remote_code
    check_verl_values(cfg)
    with pytest.raises(ValueError, match="actor_rollout_ref.model.trust_remote_code=true"):
        check_verl_values(load_config(overrides=["actor_rollout_ref.model.trust_remote_code=true"]))
