"""The colocated engine gives its memory back before any training-phase compute of a step, whichever role computes
first (issue 32, item 8): every estimator x bypass mode x reference (x critic where optional), driven by the
synchronous loop over the real ActorRolloutRefWorker / CriticWorker methods, with stand-in roles and rollout
replica that record every call in one shared log."""
from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_trainer_loop import FakeActorRollout, FakeLoader, R, length_reward  # noqa: E402

from megatron_rl.config import load_config, typed_config  # noqa: E402
from megatron_rl.plan.validate import validate  # noqa: E402
from megatron_rl.protocol import DataProto  # noqa: E402
from megatron_rl.trainer.rl_trainer import RLTrainer  # noqa: E402
from megatron_rl.workers.hybrid import ActorRolloutRefWorker, CriticWorker  # noqa: E402

COMPUTE = ("actor.compute_log_prob", "ref.compute_ref_log_prob", "critic.compute_values", "critic.update_critic",
           "actor.update_actor")


class _Offload:
    def enter(self, phase):
        pass


class _Engine:
    offload = _Offload()


class FakeReplica:
    """RolloutReplica's surface: generation (with rollout log-probs, for bypass mode), release, sync."""

    def __init__(self, log):
        self.log, self.gen = log, FakeActorRollout()

    def generate(self, prompts):
        self.log.append("rollout.generate")
        out = self.gen.generate_sequences(prompts)
        out.batch["rollout_log_probs"] = torch.zeros(len(prompts), R)
        return out

    def release(self):
        self.log.append("rollout.release")

    def sync(self, export, version, defer_verify=False):
        self.log.append("rollout.sync")
        return {"weight_sync/version": float(version)}


class FakeActor:
    engine = _Engine()

    def __init__(self, log):
        self.log = log

    def compute_log_prob(self, data):
        self.log.append("actor.compute_log_prob")
        return DataProto.from_dict({"old_log_probs": torch.zeros(len(data), R)})

    def update_actor(self, data):
        self.log.append("actor.update_actor")
        return DataProto(meta_info={"metrics": {"actor/pg_loss": 0.0}})

    def export_buckets(self, plan):
        return iter(())


class FakeRef:
    engine = _Engine()

    def __init__(self, log):
        self.log = log

    def compute_ref_log_prob(self, data):
        self.log.append("ref.compute_ref_log_prob")
        return DataProto.from_dict({"ref_log_prob": torch.zeros(len(data), R)})


class FakeCritic:
    def __init__(self, log):
        self.log = log

    def compute_values(self, data):
        self.log.append("critic.compute_values")
        return DataProto.from_dict({"values": torch.zeros(len(data), R)})

    def update_critic(self, data):
        self.log.append("critic.update_critic")
        return DataProto(meta_info={"metrics": {"critic/vf_loss": 0.0}})


ESTIMATORS = ["gae", "grpo", "rloo", "remax", "reinforce_plus_plus"]
CASES = [(est, bypass, ref, critic) for est, bypass, ref, critic
         in itertools.product(ESTIMATORS, (False, True), (False, True), (False, True))
         if critic or est != "gae"]  # gae needs the critic


@pytest.mark.parametrize("estimator,bypass,reference,critic", CASES)
def test_engine_released_before_the_first_training_compute_of_every_step(tmp_path, estimator, bypass, reference,
                                                                         critic):
    cfg = load_config(overrides=[
        f"trainer.default_local_dir={tmp_path}", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_training_steps=2",
        "trainer.save_hf_at_end=false", "trainer.save_freq=-1", f"algorithm.adv_estimator={estimator}",
        "actor_rollout_ref.model.path=/unused", "critic.model.path=/unused",
        f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}",
        f"algorithm.use_kl_in_reward={str(reference).lower()}", f"critic.enable={str(critic).lower()}",
    ])
    sizes = validate(cfg)
    log: list[str] = []
    actor_rollout = ActorRolloutRefWorker(typed_config(cfg))
    actor_rollout.actor, actor_rollout.rollout = FakeActor(log), FakeReplica(log)
    actor_rollout.ref = FakeRef(log) if reference else None
    critic_worker = None
    if critic:
        critic_worker = CriticWorker(typed_config(cfg))
        critic_worker.critic = FakeCritic(log)
    RLTrainer(cfg, sizes, actor_rollout, critic_worker, length_reward, FakeLoader(8, 2), None).fit()

    steps = [[]]
    for call in log:
        steps[-1].append(call)
        if call == "rollout.sync":
            steps.append([])
    steps = [s for s in steps if s]
    assert len(steps) == 2, log
    for step in steps:
        first_compute = next(i for i, call in enumerate(step) if call in COMPUTE)
        last_generate = max(i for i, call in enumerate(step) if call == "rollout.generate")
        assert "rollout.release" in step[last_generate:first_compute], (
            f"{step[first_compute]} ran beside the engine's memory: {step}")
        assert "critic.compute_values" in step or not critic
