"""compute_advantage: registry dispatch on a DataProto, parameter binding by name, clear errors."""

from __future__ import annotations

import pytest
import torch
from algos_data import grouped_uids, outcome_rewards, random_mask

from megatron_rl import algos
from megatron_rl.protocol import DataProto


def rollout_batch(group_sizes=(3, 3, 1, 2)) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    n = sum(group_sizes)
    mask = random_mask(n, 6, gen)
    rewards = outcome_rewards(mask, torch.randint(0, 2, (n,), generator=gen).float())
    return DataProto.from_dict(
        {
            "token_level_rewards": rewards,
            "response_mask": mask,
            "values": torch.randn(n, 6, generator=gen),
            "reward_baselines": torch.rand(n, generator=gen),
        },
        {"uid": grouped_uids(list(group_sizes))},
    )


def direct_call(name: str, data: DataProto):
    b, uid = data.batch, data.non_tensor_batch["uid"]
    r, m = b["token_level_rewards"], b["response_mask"]
    return {
        "gae": lambda: algos.compute_gae_advantage_return(r, b["values"], m, 0.9, 0.8),
        "grpo": lambda: algos.compute_grpo_outcome_advantage(r, m, uid, norm_adv_by_std_in_grpo=False),
        "rloo": lambda: algos.compute_rloo_outcome_advantage(r, m, uid),
        "reinforce_plus_plus_baseline": lambda: algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
            r, m, uid
        ),
        "reinforce_plus_plus": lambda: algos.compute_reinforce_plus_plus_outcome_advantage(r, m, 0.9),
        "remax": lambda: algos.compute_remax_outcome_advantage(r, b["reward_baselines"], m),
    }[name]()


@pytest.mark.parametrize(
    "name", ["gae", "grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus", "remax"]
)
def test_dispatch_writes_what_the_direct_call_returns(name):
    data = rollout_batch()
    out = algos.compute_advantage(data, name, gamma=0.9, lam=0.8, num_repeat=3, norm_adv_by_std_in_grpo=False)
    assert out is data
    advantages, returns = direct_call(name, rollout_batch())
    assert torch.equal(data.batch["advantages"], advantages)
    assert torch.equal(data.batch["returns"], returns)


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown advantage estimator 'ppo' \(algorithm.adv_estimator\); "
        r"known: \['gae', 'grpo', 'rloo'",
    ):
        algos.compute_advantage(rollout_batch(), "ppo")


def test_missing_field_is_named():
    data = rollout_batch()
    data.pop(batch_keys=["values"])
    with pytest.raises(ValueError, match=r"adv_estimator 'gae' needs batch\[\"values\"\]"):
        algos.compute_advantage(data, "gae")
    data.pop(non_tensor_batch_keys=["uid"])
    with pytest.raises(ValueError, match=r"adv_estimator 'grpo' needs non_tensor_batch\[\"uid\"\]"):
        algos.compute_advantage(data, "grpo")


def test_custom_estimator_gets_fields_and_options_by_name():
    seen = {}

    @algos.register_adv_estimator("test_custom_scaled_grpo")
    def scaled(token_level_rewards, response_mask, index, num_repeat, scale=1.0, config=None, **kwargs):
        seen.update(num_repeat=num_repeat, scale=scale, config=config, extra=sorted(kwargs))
        adv, _ = algos.compute_grpo_outcome_advantage(token_level_rewards, response_mask, index)
        return adv * scale, adv

    assert "test_custom_scaled_grpo" in algos.list_adv_estimators()
    data = algos.compute_advantage(
        rollout_batch(), "test_custom_scaled_grpo", num_repeat=3, config={"k": 1}, scale=2.0
    )
    assert seen == {
        "num_repeat": 3,
        "scale": 2.0,
        "config": {"k": 1},
        "extra": ["gamma", "lam", "norm_adv_by_std_in_grpo"],
    }
    torch.testing.assert_close(data.batch["advantages"], 2 * data.batch["returns"])
    with pytest.raises(ValueError, match="already registered"):
        algos.register_adv_estimator("grpo")(scaled)


def test_estimator_returning_the_wrong_shape_is_caught():
    @algos.register_adv_estimator("test_bad_shape")
    def bad(token_level_rewards):
        return token_level_rewards[:, :1], token_level_rewards

    with pytest.raises(
        ValueError, match=r"'test_bad_shape' returned advantages of shape \(9, 1\), expected \(9, 6\)"
    ):
        algos.compute_advantage(rollout_batch(), "test_bad_shape")


@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.bool])
def test_grpo_on_a_large_batch_matches_the_formula(mask_dtype):
    """The CPU fast path (serial row sums, broadcast into a reused block) on a batch over 4 MiB, twice."""
    gen = torch.Generator().manual_seed(3)
    sizes = [16] * 70 + [1, 3]  # with a group of one
    n = sum(sizes)
    mask = random_mask(n, 1001, gen).to(mask_dtype)
    rewards = outcome_rewards(mask.float(), torch.randint(0, 2, (n,), generator=gen).float())
    rewards += torch.randn(n, 1001, generator=gen) * 0.01 * mask
    uids = grouped_uids(sizes)
    scores = rewards.sum(dim=-1)
    expected = torch.empty(n)
    start = 0
    for size in sizes:
        group = scores[start : start + size]
        std = group.std() if size > 1 else torch.tensor(1.0)
        expected[start : start + size] = (group - (group.mean() if size > 1 else 0)) / (std + 1e-6)
        start += size
    for _ in range(2):
        advantages, returns = algos.compute_grpo_outcome_advantage(rewards, mask, uids)
        assert advantages is returns and advantages.dtype == torch.float32
        torch.testing.assert_close(advantages, expected.unsqueeze(-1) * mask, rtol=1e-5, atol=1e-5)
        del advantages, returns
