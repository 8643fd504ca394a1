"""megatron_rl.compat.verl: verl's import paths and names, backed by megatron-rl's own code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import megatron_rl.algos as algos
from megatron_rl.compat.verl import DataProto
from megatron_rl.compat.verl import protocol as verl_protocol
from megatron_rl.compat.verl.trainer.ppo import core_algos
from megatron_rl.compat.verl.utils import reward_score
from megatron_rl.compat.verl.protocol import DataProto as OurDataProto


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


def test_estimators_take_verls_config_argument():
    from types import SimpleNamespace

    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    by_config, _ = core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=SimpleNamespace(gamma=0.5))
    by_keyword, _ = algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    by_old_order, _ = algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.5)
    torch.testing.assert_close(by_config, by_keyword)
    torch.testing.assert_close(by_config, by_old_order)
    with pytest.raises(ValueError, match="needs the discount"):
        core_algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask)
    index = np.array(["a", "a"], dtype=object)
    cfg = SimpleNamespace(gamma=1.0, norm_adv_by_std_in_grpo=True)
    for fn in (core_algos.compute_grpo_outcome_advantage, core_algos.compute_rloo_outcome_advantage,
               core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage):
        fn(rewards, mask, index, 1e-6, config=cfg)  # verl passes config= to every estimator
    core_algos.compute_remax_outcome_advantage(rewards, torch.zeros(2), mask, config=cfg, unused=1)


def test_value_loss_takes_verls_normalisers_positionally():
    g = torch.Generator().manual_seed(0)
    vpreds, returns, values = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.ones(3, 4)
    loss, clipfrac = core_algos.compute_value_loss(vpreds, returns, values, mask, 0.2, "token-mean", 2, 24)
    ours, ours_clipfrac = algos.compute_value_loss(vpreds, returns, values, mask, 0.2, "token-mean",
                                                   algos.GlobalBatchInfo(global_num_tokens=24, dp_size=2))
    torch.testing.assert_close(loss, ours)
    torch.testing.assert_close(clipfrac, ours_clipfrac)
    half, _ = core_algos.compute_value_loss(vpreds, returns, values, mask, 0.2)
    torch.testing.assert_close(loss, half)  # 12 of 24 tokens here, times dp_size 2 = the local mean


def test_rollout_corr_helper_returns_weights_in_a_data_proto_like_verl():
    from megatron_rl.compat.verl.trainer.ppo import rollout_corr_helper as helper

    old, roll, mask = torch.zeros(2, 3), torch.full((2, 3), -0.1), torch.ones(2, 3)
    proto, out_mask, metrics = helper.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is="token")
    assert isinstance(proto, DataProto)
    torch.testing.assert_close(proto.batch["rollout_is_weights"], torch.full((2, 3), float(np.exp(0.1))))
    assert "rollout_corr/chi2_token" in metrics and "seq_max_k3" in helper.SUPPORTED_ROLLOUT_RS_OPTIONS
    batch = DataProto.from_dict({"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask})
    batch, metrics = helper.compute_rollout_correction_and_add_to_batch(batch, {"rollout_is": "sequence"})
    assert "rollout_is_weights" in batch.batch.keys() and "rollout_corr/rollout_is_mean" in metrics


def test_verl_top_level_custom_reward_function_and_middle_truncation():
    """Issue 33: verl's top-level custom_reward_function.path/name were not translated (refused as unknown keys by
    the schema) and data.truncation=middle was refused; middle is verl's own mode now and passes as is."""
    from megatron_rl.compat.verl.trainer.main_ppo import translate
    from megatron_rl.config import load_config

    assert translate(["custom_reward_function.path=/x/score.py", "custom_reward_function.name=my_score",
                      "data.truncation=middle"], with_verl_defaults=False) == [
                          "++reward.custom_reward_function.path=/x/score.py",
                          "++reward.custom_reward_function.name=my_score",
                                                     "data.truncation=middle"]
    assert load_config(overrides=["data.truncation=middle"]).data.truncation == "middle"
