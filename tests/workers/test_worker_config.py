"""What the workers are given: the validated config as its dataclass tree, ``PPOTrainerConfig`` (issue 31).
The Ray path (pickled init arguments) is tests/controller/test_controller_groups.py's
test_the_typed_trainer_config_reaches_ray_workers and the e2e runs; here the torchrun path and the refusal."""
from __future__ import annotations

import pickle

import pytest
from config_jobs import torchrun_groups_job

from megatron_rl.config import PPOTrainerConfig, load_config, typed_config
from megatron_rl.distributed import run_multiprocess

OVERRIDES = ["+experiment=grpo_tiny_cpu", "data.train_files=[unused.parquet]", "actor_rollout_ref.model.path=/nowhere",
             "trainer.launcher=torchrun", "trainer.n_gpus_per_node=2",  # two ranks: the preset's before issue 39
             "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
             "actor_rollout_ref.actor.megatron.share_prompts=false", "algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true",
             "actor_rollout_ref.actor.kl_loss_type=k3+", "critic.megatron.params_dtype=fp32"]


@pytest.mark.distributed
def test_torchrun_workers_receive_the_typed_config():
    results = run_multiprocess(torchrun_groups_job, 2, OVERRIDES, timeout_s=300)
    for result in results:
        assert result == {"actor": "PPOTrainerConfig", "critic": "PPOTrainerConfig", "typed": True, "equal": True,
                          "kl_loss_type": "KLPenalty", "params_dtype": "fp32", "critic_path": "/nowhere",
                          "reward_model": None}


def test_typed_config_is_the_schema_dataclass_and_pickles():
    cfg = load_config(overrides=OVERRIDES)
    typed = typed_config(cfg)
    assert isinstance(typed, PPOTrainerConfig) and typed_config(typed) is typed
    assert pickle.loads(pickle.dumps(typed)) == typed
    assert typed.actor_rollout_ref.actor.kl_loss_type == "k3+" and typed.critic.model.path == "/nowhere"
    assert isinstance(typed.actor_rollout_ref.model.override_config, dict)


def test_workers_refuse_an_untyped_config():
    from megatron_rl.workers.hybrid import ActorRolloutRefWorker, CriticWorker
    from megatron_rl.workers.reward_model import RewardModelWorker

    cfg = load_config(overrides=OVERRIDES)
    for worker in (ActorRolloutRefWorker, CriticWorker, RewardModelWorker):
        with pytest.raises(TypeError, match=f"{worker.__name__} takes the trainer config as a PPOTrainerConfig"):
            worker(config=cfg)
        assert worker(config=typed_config(cfg)).config.trainer.launcher == "torchrun"
