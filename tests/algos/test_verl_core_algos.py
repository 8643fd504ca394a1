"""verl's core_algos interface on our implementation: positional order, registries, Enum keys, traits.

The oracle tests (``verl_core_algos`` fixture) skip when verl is not importable; the rest always run.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import megatron_rl.algos as algos
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate

TOL = dict(rtol=1e-5, atol=1e-5)


def _batch(seed: int, b: int = 6, t: int = 7):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 2
    lp = old + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, t, generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.25).float()
    mask[:, 0] = 1
    return old, lp, adv, mask


# ---------------------------------------------------------------- agg_loss


def test_agg_loss_takes_verls_positional_order():
    _, loss, _, mask = _batch(1)
    # (loss_mat, loss_mask, mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    ours = algos.agg_loss(loss, mask, "token-mean", 4, 80.0)
    assert ours.item() == pytest.approx((loss * mask).sum().item() / 80.0 * 4, rel=1e-6)
    seq = algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", 2, None, 12, 5)
    assert seq.item() == pytest.approx((loss * mask).sum().item() / 12 * 2 / 5, rel=1e-6)
    assert algos.agg_loss(loss, mask, "token-sum").item() == pytest.approx((loss * mask).sum().item(), rel=1e-6)
    assert algos.agg_loss(loss, mask, "token-sum", 3).item() == pytest.approx(
        3 * (loss * mask).sum().item(), rel=1e-6
    )


def test_agg_loss_dp_size_without_counts_is_refused_not_scaled():
    _, loss, _, mask = _batch(2)
    with pytest.raises(ValueError, match="dp_size=10\\) needs global_num_tokens"):
        algos.agg_loss(loss, mask, "token-mean", 10)
    # A count where dp_size sits (the old order) is refused instead of multiplying the loss.
    with pytest.raises(ValueError, match="dp_size must be a positive int, got 37.0.*verl's positional order"):
        algos.agg_loss(loss, mask, "token-mean", 37.0)
    with pytest.raises(ValueError, match="not both"):
        algos.agg_loss(loss, mask, "token-mean", 1, 10, global_num_tokens=10)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_matches_verl_positionally(verl_core_algos, mode):
    _, loss, _, mask = _batch(3)
    for args in ((), (1,), (2, 50.0, 9, 11), (4, 123.0, 20, None)):
        ours = algos.agg_loss(loss, mask, mode, *args)
        theirs = verl_core_algos.agg_loss(loss, mask, mode, *args)
        torch.testing.assert_close(ours, theirs.to(ours.dtype), **TOL)


# ---------------------------------------------------------------- policy loss positional order


def test_vanilla_applies_is_weights_passed_positionally():
    old, lp, adv, mask = _batch(4)
    weights = torch.rand_like(old) * 2
    plain, _ = algos.compute_policy_loss_vanilla(old, lp, adv, mask, "token-sum", algos.PolicyLossConfig())
    weighted, _ = algos.compute_policy_loss_vanilla(
        old, lp, adv, mask, "token-sum", algos.PolicyLossConfig(), weights
    )
    assert weighted.item() != pytest.approx(plain.item(), rel=1e-3)
    ones, _ = algos.compute_policy_loss_vanilla(
        old, lp, adv, mask, "token-sum", algos.PolicyLossConfig(), torch.ones_like(old)
    )
    assert ones.item() == pytest.approx(plain.item(), rel=1e-6)
    # Log-probs in the IS-weight slot (our old 7th argument) are refused by name.
    with pytest.raises(ValueError, match="pass them as rollout_log_probs="):
        algos.compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", None, old)


def test_vanilla_reads_verl_global_batch_info_from_the_config():
    old, lp, adv, mask = _batch(5)
    cfg = OmegaConf.create(
        {"clip_ratio": 0.2, "clip_ratio_low": None, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
         "global_batch_info": {"dp_size": 2, "batch_num_tokens": 100, "global_batch_size": 12}}
    )
    loss, _ = algos.compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", cfg)
    explicit, _ = algos.compute_policy_loss_vanilla(
        old, lp, adv, mask, "token-mean", algos.PolicyLossConfig(clip_ratio_high=0.28),
        global_batch=algos.GlobalBatchInfo(100, 12, 2),
    )
    torch.testing.assert_close(loss, explicit)
    local, _ = algos.compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", algos.PolicyLossConfig())
    assert loss.item() != pytest.approx(local.item(), rel=1e-3)


def test_policy_losses_match_verl_with_is_weights_and_global_batch(verl_core_algos):
    from verl.workers.config import ActorConfig as VerlActorConfig

    old, lp, adv, mask = _batch(6)
    weights = torch.rand_like(old) * 2
    verl_cfg = VerlActorConfig(strategy="megatron", clip_ratio_high=0.28, clip_ratio_c=2.0,
                               ppo_micro_batch_size_per_gpu=1, rollout_n=2)
    verl_cfg.global_batch_info.update(dp_size=2, batch_num_tokens=70, global_batch_size=9)
    for name in ("vanilla", "gspo"):
        ours_fn, verl_fn = algos.get_policy_loss_fn(name), verl_core_algos.get_policy_loss_fn(name)
        for mode in ("token-mean", "seq-mean-token-mean", "token-sum"):
            a = ours_fn(old, lp, adv, mask, mode, verl_cfg, weights)
            b = verl_fn(old, lp, adv, mask, mode, verl_cfg, weights)
            torch.testing.assert_close(a[0], b[0], **TOL)
            assert a[1] == pytest.approx(b[1], abs=1e-6)


def test_policy_loss_config_from_verl_shaped_actor_configs(verl_core_algos):
    from verl.workers.config import ActorConfig as VerlActorConfig

    verl_cfg = VerlActorConfig(strategy="megatron", clip_ratio=0.1, clip_ratio_low=0.05, clip_ratio_c=4.0,
                               ppo_micro_batch_size_per_gpu=1, rollout_n=2)
    ours = algos.PolicyLossConfig.from_actor_config(verl_cfg)
    assert (ours.clip_ratio, ours.low, ours.high, ours.clip_ratio_c) == (0.1, 0.05, verl_cfg.clip_ratio_high, 4.0)
    assert ours.tis_imp_ratio_cap is None


def test_policy_loss_config_from_dictconfig_and_dict():
    dc = OmegaConf.create({"clip_ratio": 0.3, "policy_loss": {"loss_mode": "vanilla"}, "ppo_epochs": 1})
    assert algos.PolicyLossConfig.from_actor_config(dc) == algos.PolicyLossConfig(clip_ratio=0.3)
    assert algos.PolicyLossConfig.from_actor_config({"clip_ratio_high": 0.28}).high == 0.28


# ---------------------------------------------------------------- registries and Enum keys


def test_module_level_registries_and_enum_keys():
    assert algos.ADV_ESTIMATOR_REGISTRY["grpo"] is algos.compute_grpo_outcome_advantage
    assert algos.get_adv_estimator_fn(algos.AdvantageEstimator.GAE) is algos.compute_gae_advantage_return
    assert algos.AdvantageEstimator.GRPO in algos.ADV_ESTIMATOR_REGISTRY
    assert algos.POLICY_LOSS_REGISTRY["vanilla"] is algos.compute_policy_loss_vanilla
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope' \(algorithm.adv_estimator\)"):
        algos.get_adv_estimator_fn("nope")


def test_registries_are_mutable_like_verls_dicts_and_keep_traits():
    def critic_user(token_level_rewards, values, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    algos.ADV_ESTIMATOR_REGISTRY["test18_assigned"] = critic_user  # verl code assigns into the dict
    try:
        assert algos.get_adv_estimator_fn("test18_assigned") is critic_user
        assert algos.get_estimator_traits("test18_assigned").needs_critic  # described like a decorated one
        assert algos.ADV_ESTIMATOR_REGISTRY.get("test18_missing") is None  # dict semantics for .get
    finally:
        del algos.ADV_ESTIMATOR_REGISTRY["test18_assigned"]
    assert "test18_assigned" not in algos.ADV_ESTIMATOR_REGISTRY
    with pytest.raises(ValueError, match="unknown advantage estimator 'test18_assigned'"):
        algos.get_estimator_traits("test18_assigned")
    with pytest.raises(ValueError, match="must be callable"):
        algos.ADV_ESTIMATOR_REGISTRY["test18_bad"] = 3


def test_compat_policy_loss_registration_replaces_as_in_verl_native_refuses():
    from megatron_rl.compat.verl.trainer.ppo import core_algos

    def first(*args, **kwargs):
        return None

    def second(*args, **kwargs):
        return None

    core_algos.register_policy_loss("test18_loss")(first)
    try:
        core_algos.register_policy_loss("test18_loss")(second)  # verl: the later registration wins
        assert core_algos.get_policy_loss_fn("test18_loss") is second is algos.get_policy_loss_fn("test18_loss")
        with pytest.raises(ValueError, match="already registered"):
            algos.register_policy_loss("test18_loss")(first)  # megatron-rl's own decorator refuses
    finally:
        del algos.POLICY_LOSS_REGISTRY["test18_loss"]
    with pytest.raises(ValueError, match="Unsupported loss mode: test18_loss"):
        core_algos.get_policy_loss_fn("test18_loss")


def test_compat_registry_functions_follow_a_rebound_module_attribute(monkeypatch):
    from megatron_rl.compat.verl.trainer.ppo import core_algos

    own = {"double": lambda x: 2 * x}
    monkeypatch.setattr(core_algos, "ADV_ESTIMATOR_REGISTRY", own)  # what verl's own tests do

    @core_algos.register_adv_est("test18_in_own_dict")
    def est(x):
        return x

    assert own["test18_in_own_dict"] is est and "test18_in_own_dict" not in algos.ADV_ESTIMATOR_REGISTRY
    assert core_algos.get_adv_estimator_fn("double")(3) == 6
    with pytest.raises(ValueError, match="Unknown advantage estimator simply: nope"):
        core_algos.get_adv_estimator_fn("nope")
    with pytest.raises(ValueError, match="already been registered"):
        core_algos.register_adv_est("double")(est)


def test_verls_own_enum_members_are_accepted(verl_core_algos):
    assert algos.get_adv_estimator_fn(verl_core_algos.AdvantageEstimator.RLOO) is algos.compute_rloo_outcome_advantage


def test_estimator_traits_declared_and_inferred():
    traits = algos.get_estimator_traits
    assert traits("gae").needs_critic and not traits("gae").needs_groups
    assert traits("grpo").needs_groups and traits("rloo").needs_groups
    assert traits(algos.AdvantageEstimator.REMAX).needs_greedy_baseline
    assert traits("reinforce_plus_plus") == algos.EstimatorTraits()

    @algos.register_adv_est("test18_value_user")
    def value_user(token_level_rewards, values, response_mask, gamma, **kwargs):
        return token_level_rewards - values, token_level_rewards

    @algos.register_adv_estimator("test18_declared", needs_groups=True)
    def declared(token_level_rewards, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    assert traits("test18_value_user") == algos.EstimatorTraits(needs_critic=True)
    assert traits("test18_declared") == algos.EstimatorTraits(needs_groups=True)


def _cfg(*overrides):
    return load_config(overrides=[
        "trainer.nnodes=1", "trainer.n_gpus_per_node=2", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        *overrides,
    ])


def test_a_user_estimator_is_validated_like_ours():
    @algos.register_adv_estimator("test18_needs_critic")
    def critic_user(token_level_rewards, values, response_mask, **kwargs):
        return token_level_rewards, token_level_rewards

    @algos.register_adv_estimator("test18_needs_groups")
    def group_user(token_level_rewards, response_mask, index, **kwargs):
        return token_level_rewards, token_level_rewards

    with pytest.raises(ConfigError, match="'test18_needs_critic' needs values, but critic.enable=false"):
        validate(_cfg("algorithm.adv_estimator=test18_needs_critic", "critic.enable=false",
                      "actor_rollout_ref.rollout.n=2"))
    sizes = validate(_cfg("algorithm.adv_estimator=test18_needs_critic", "actor_rollout_ref.rollout.n=2",
                          "critic.ppo_micro_batch_size_per_gpu=2"))
    assert sizes.uses_critic
    with pytest.raises(ConfigError, match="'test18_needs_groups' compares responses within a group"):
        validate(_cfg("algorithm.adv_estimator=test18_needs_groups", "actor_rollout_ref.rollout.n=1"))


def test_vectorized_estimators_match_verl(verl_core_algos):
    import numpy as np

    gen = torch.Generator().manual_seed(11)
    rewards = torch.randn(7, 5, generator=gen)
    mask = torch.ones(7, 5)
    index = np.array(["a", "a", "b", "b", "b", "c", "d"], dtype=object)  # c, d: groups of one
    for name in ("grpo_vectorized", "rloo_vectorized"):
        ours = algos.get_adv_estimator_fn(name)(rewards, mask, index)
        theirs = verl_core_algos.get_adv_estimator_fn(name)(rewards, mask, index)
        torch.testing.assert_close(ours[0], theirs[0], **TOL)
    assert algos.compute_rloo_vectorized_outcome_advantage(rewards, mask, index)[0][5:].abs().sum() == 0
