"""Decoupled PPO (actor.policy_loss=decoupled_ppo, AReaL's proximal policy) against a hand-written per-token
reference: the clip on pi/pi_prox, the behaviour->proximal weight multiplying it, capped tokens at weight 0
but still in the token-mean's denominator; and, uncapped, the same loss as vanilla PPO with verl's token-level
rollout-IS weights exp(old - rollout) (no truncation)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos.policy_loss import PolicyLossConfig, get_policy_loss


def _batch(seed: int = 0, rows: int = 3, width: int = 5):
    gen = torch.Generator().manual_seed(seed)
    behaviour = -torch.rand(rows, width, generator=gen) * 2
    proximal = behaviour + (torch.rand(rows, width, generator=gen) - 0.5) * 1.6  # staleness: up to e^0.8 apart
    current = (proximal + (torch.rand(rows, width, generator=gen) - 0.5) * 0.8).requires_grad_(True)
    advantages = torch.randn(rows, width, generator=gen)
    mask = torch.ones(rows, width)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return behaviour, proximal, current, advantages, mask


def _reference(behaviour, proximal, current, advantages, mask, low=0.2, high=0.28, dual=3.0, cap=None):
    """AReaL's formula written out token by token."""
    total, count, current = 0.0, 0, current.detach()
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if not mask[i, t]:
                continue
            count += 1
            a = float(advantages[i, t])
            r = math.exp(float(current[i, t]) - float(proximal[i, t]))
            loss = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if a < 0:
                loss = min(loss, -a * dual)
            w = math.exp(float(proximal[i, t]) - float(behaviour[i, t]))
            if cap is not None and w > cap:
                w = 0.0
            total += loss * w
    return total / count


@pytest.mark.parametrize("cap", [None, 1.2])
def test_matches_the_hand_written_reference(cap):
    behaviour, proximal, current, advantages, mask = _batch()
    config = PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, behav_imp_weight_cap=cap)
    loss, metrics = get_policy_loss("decoupled_ppo")(proximal, current, advantages, mask, "token-mean", config,
                                                     rollout_log_probs=behaviour)
    assert loss.item() == pytest.approx(_reference(behaviour, proximal, current, advantages, mask, cap=cap), abs=1e-6)
    weights = torch.exp(proximal - behaviour)[mask.bool()]
    if cap is None:
        assert metrics["actor/behav_capped_frac"] == 0.0
        assert metrics["actor/behav_imp_weight_max"] == pytest.approx(weights.max().item(), rel=1e-6)
    else:
        assert 0 < metrics["actor/behav_capped_frac"] < 1  # the test data has weights on both sides of the cap
        assert metrics["actor/behav_capped_frac"] == pytest.approx((weights > cap).float().mean().item())
        assert metrics["actor/behav_imp_weight_max"] <= cap
    loss.backward()
    assert current.grad is not None and current.grad[~mask.bool()].abs().max() == 0  # padding gets no gradient


def test_uncapped_equals_vanilla_with_token_rollout_is_weights():
    behaviour, proximal, current, advantages, mask = _batch(seed=3)
    decoupled, _ = get_policy_loss("decoupled_ppo")(proximal, current, advantages, mask,
                                                    rollout_log_probs=behaviour)
    vanilla, _ = get_policy_loss("vanilla")(proximal, current, advantages, mask, "token-mean", None,
                                            torch.exp(proximal - behaviour) * mask)
    assert decoupled.item() == pytest.approx(vanilla.item(), abs=1e-7)


def test_refusals():
    behaviour, proximal, current, advantages, mask = _batch()
    loss = get_policy_loss("decoupled_ppo")
    with pytest.raises(ValueError, match="needs rollout_log_probs"):
        loss(proximal, current, advantages, mask)
    with pytest.raises(ValueError, match="unset algorithm.rollout_correction.rollout_is"):
        loss(proximal, current, advantages, mask, "token-mean", None, torch.ones_like(mask), rollout_log_probs=behaviour)
    with pytest.raises(ValueError, match="behav_imp_weight_cap must be > 0"):
        PolicyLossConfig(behav_imp_weight_cap=0.0)
