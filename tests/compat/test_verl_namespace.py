"""megatron_rl.compat.verl: verl's import paths and names, backed by megatron-rl's own code."""

from __future__ import annotations

import torch

import megatron_rl.algos as algos
from megatron_rl.compat.verl import DataProto
from megatron_rl.compat.verl import protocol as verl_protocol
from megatron_rl.compat.verl.trainer.ppo import core_algos
from megatron_rl.compat.verl.utils import reward_score
from megatron_rl.protocol import DataProto as OurDataProto


def test_the_namespace_is_ours():
    assert DataProto is OurDataProto and verl_protocol.DataProto is OurDataProto
    assert core_algos.compute_grpo_outcome_advantage is algos.compute_grpo_outcome_advantage
    assert core_algos.agg_loss is algos.agg_loss
    assert core_algos.get_policy_loss_fn("vanilla") is algos.compute_policy_loss_vanilla


def test_a_verl_style_estimator_registers_in_megatron_rl():
    @core_algos.register_adv_est("test18_compat_est")
    def est(token_level_rewards, response_mask, index, config=None, **kwargs):
        return token_level_rewards, token_level_rewards

    assert algos.get_adv_estimator("test18_compat_est") is est
    assert algos.get_estimator_traits("test18_compat_est").needs_groups
    assert "test18_compat_est" in core_algos.ADV_ESTIMATOR_REGISTRY


def test_entropy_loss_takes_logits_like_verl():
    logits = torch.randn(2, 3, 5)
    mask = torch.ones(2, 3)
    p = torch.softmax(logits, -1)
    want = -(p * torch.log(p)).sum(-1).mean()
    torch.testing.assert_close(core_algos.compute_entropy_loss(logits, mask), want)


def test_compute_rewards():
    scores, old, ref = torch.ones(1, 2), torch.tensor([[0.5, 0.0]]), torch.zeros(1, 2)
    torch.testing.assert_close(core_algos.compute_rewards(scores, old, ref, 0.1), torch.tensor([[0.95, 1.0]]))


def test_reward_score_dispatch():
    assert reward_score.default_compute_score("openai/gsm8k", "so #### 42", "42") == 1.0
    assert reward_score.default_compute_score("lighteval/MATH", "\\boxed{\\frac12}", "0.5") == 1.0
