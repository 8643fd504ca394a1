"""LR schedule from OptimConfig (Megatron's OptimizerParamScheduler, stepped once per update call)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from megatron_rl.config.schema import OptimConfig
from megatron_rl.workers.lr_schedule import build_lr_scheduler


def lrs(optim: OptimConfig, steps: int) -> list[float]:
    optimizer = SimpleNamespace(param_groups=[{}])
    scheduler = build_lr_scheduler(optimizer, optim, "actor_rollout_ref.actor.optim")
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        scheduler.step(1)
    return out


def test_constant_with_and_without_warmup():
    assert lrs(OptimConfig(lr=1e-3), 3) == [1e-3] * 3
    assert lrs(OptimConfig(lr=1e-3, lr_warmup_steps=4), 6) == pytest.approx(
        [0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3]
    )


def test_warmup_then_cosine_to_the_minimum():
    optim = OptimConfig(
        lr=1e-3, lr_warmup_steps=2, lr_scheduler="cosine", total_training_steps=6, min_lr_ratio=0.1
    )
    expected = [0.0, 5e-4, 1e-3]
    for step in range(3, 8):
        ratio = min((step - 2) / 4, 1.0)
        expected.append(1e-4 + 0.5 * (1 + math.cos(math.pi * ratio)) * 9e-4)
    assert lrs(optim, 8) == pytest.approx(expected)


def test_weight_decay_is_constant():
    optimizer = SimpleNamespace(
        param_groups=[{}, {"wd_mult": 0.0}]
    )  # Megatron's no-decay group (norms, biases)
    scheduler = build_lr_scheduler(optimizer, OptimConfig(weight_decay=0.05), "critic.optim")
    scheduler.step(3)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.05, 0.0]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match=r"actor_rollout_ref.actor.optim.lr_scheduler='linear' is unknown"):
        lrs(OptimConfig(lr_scheduler="linear"), 1)
    with pytest.raises(
        ValueError, match=r"optim.lr_scheduler=cosine needs .*total_training_steps > lr_warmup_steps"
    ):
        lrs(OptimConfig(lr_scheduler="cosine"), 1)
    with pytest.raises(ValueError, match=r"optim.min_lr_ratio must be in \[0, 1\], got 2"):
        lrs(OptimConfig(min_lr_ratio=2), 1)
