"""``optim.total_training_steps: -1`` is filled with the run's step count before the workers are built (verl's
rule), so ``lr_scheduler=cosine`` decays over the run instead of failing at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from megatron_rl.config import load_config
from megatron_rl.trainer.loop import fill_optimizer_steps, planned_steps
from megatron_rl.workers.lr_schedule import build_lr_scheduler


def _cfg(*overrides):
    return load_config(overrides=["actor_rollout_ref.actor.optim.lr_scheduler=cosine", *overrides])


def test_minus_one_becomes_the_runs_step_count_and_cosine_builds_from_it():
    cfg = _cfg("trainer.total_training_steps=12", "critic.optim.total_training_steps=7")
    fill_optimizer_steps(cfg, batches_per_epoch=5)
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps == 12
    assert cfg.critic.optim.total_training_steps == 7  # set by the user: kept
    optim = OmegaConf.to_object(cfg.actor_rollout_ref.actor.optim)
    optimizer = SimpleNamespace(param_groups=[{}])
    build_lr_scheduler(optimizer, optim, "actor_rollout_ref.actor.optim")  # refused with -1 before the fill
    assert optimizer.param_groups[0]["lr"] == pytest.approx(optim.lr)  # no warm-up: starts at the peak


def test_without_a_step_count_it_is_epochs_times_batches():
    cfg = _cfg("trainer.total_training_steps=null", "trainer.total_epochs=3")
    assert planned_steps(cfg, batches_per_epoch=4) == 12
    fill_optimizer_steps(cfg, batches_per_epoch=4)
    assert cfg.actor_rollout_ref.actor.optim.total_training_steps == 12
    with pytest.raises(ValueError, match="the training data gives 0 steps"):
        planned_steps(cfg, batches_per_epoch=0)
