"""Advantage estimators against REFERENCE.md §1 written as loops, and against verl itself when present."""

from __future__ import annotations

import algos_loop_reference as ref
import numpy as np
import pytest
import torch
from algos_data import grouped_uids, outcome_rewards, random_mask

from megatron_rl import algos

GROUP_SIZES = [4, 4, 1, 3, 2, 6, 4]  # includes a singleton group
B, T = sum(GROUP_SIZES), 11
TOL = dict(atol=1e-5, rtol=1e-5)


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64).reshape(actual.shape)
    torch.testing.assert_close(actual.double(), expected, **TOL)


def make_batch(seed: int, mask_kind: str, reward_kind: str):
    gen = torch.Generator().manual_seed(seed)
    if mask_kind == "right_padded":
        mask = random_mask(B, T, gen, empty_rows=(2,))
    else:  # multi-turn: observation tokens (mask 0) inside the response
        mask = (torch.rand(B, T, generator=gen) > 0.35).float()
        mask[2] = 0.0
    if reward_kind == "outcome":
        rewards = outcome_rewards(mask, torch.randint(0, 3, (B,), generator=gen).float())
    else:
        rewards = torch.randn(B, T, generator=gen) * mask
    values = torch.randn(B, T, generator=gen)
    return rewards, values, mask


BATCHES = [
    (0, "right_padded", "outcome"),
    (1, "right_padded", "dense"),
    (2, "multi_turn", "dense"),
    (3, "multi_turn", "outcome"),
]


@pytest.mark.parametrize("seed,mask_kind,reward_kind", BATCHES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_loop(seed, mask_kind, reward_kind, gamma, lam):
    rewards, values, mask = make_batch(seed, mask_kind, reward_kind)
    adv, ret = algos.compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    exp_adv, exp_ret = ref.gae(rewards, values, mask, gamma, lam)
    close(adv, exp_adv)
    close(ret, exp_ret)


@pytest.mark.parametrize("seed,mask_kind,reward_kind", BATCHES)
@pytest.mark.parametrize("as_str", [True, False])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_loop(seed, mask_kind, reward_kind, as_str, norm):
    rewards, _, mask = make_batch(seed, mask_kind, reward_kind)
    uids = grouped_uids(GROUP_SIZES, as_str)
    adv, ret = algos.compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=norm)
    close(adv, ref.grpo(rewards, mask, list(uids), norm=norm)[0])
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed,mask_kind,reward_kind", BATCHES)
def test_rloo_matches_loop(seed, mask_kind, reward_kind):
    rewards, _, mask = make_batch(seed, mask_kind, reward_kind)
    uids = grouped_uids(GROUP_SIZES)
    adv, ret = algos.compute_rloo_outcome_advantage(rewards, mask, uids)
    close(adv, ref.rloo(rewards, mask, list(uids))[0])
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("seed,mask_kind,reward_kind", BATCHES)
def test_reinforce_pp_baseline_matches_loop(seed, mask_kind, reward_kind):
    rewards, _, mask = make_batch(seed, mask_kind, reward_kind)
    uids = grouped_uids(GROUP_SIZES, as_str=False)
    adv, _ = algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids)
    close(adv, ref.reinforce_pp_baseline(rewards, mask, list(uids))[0])


@pytest.mark.parametrize("seed,mask_kind,reward_kind", BATCHES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_loop(seed, mask_kind, reward_kind, gamma):
    rewards, _, mask = make_batch(seed, mask_kind, reward_kind)
    adv, ret = algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma)
    exp_adv, exp_ret = ref.reinforce_pp(rewards, mask, gamma)
    close(adv, exp_adv)
    close(ret, exp_ret)


@pytest.mark.parametrize("seed,mask_kind,reward_kind", BATCHES)
def test_remax_matches_loop(seed, mask_kind, reward_kind):
    rewards, _, mask = make_batch(seed, mask_kind, reward_kind)
    baselines = torch.randn(B, generator=torch.Generator().manual_seed(seed))
    adv, ret = algos.compute_remax_outcome_advantage(rewards, baselines, mask)
    exp_adv, exp_ret = ref.remax(rewards, baselines, mask)
    close(adv, exp_adv)
    close(ret, exp_ret)


# ---------------------------------------------------------------- edge cases


def test_group_edge_cases_singleton_zero_variance_empty_row():
    mask = torch.ones(6, 3)
    mask[4] = 0.0  # empty response inside a group
    scores = torch.tensor([1.0, 1.0, 1.0, 5.0, 0.0, 2.0])
    rewards = outcome_rewards(torch.ones(6, 3), scores)
    uids = np.array(["same", "same", "same", "alone", "pair", "pair"], dtype=object)
    adv, _ = algos.compute_grpo_outcome_advantage(rewards, mask, uids)
    assert torch.all(adv[:3] == 0)  # zero variance -> zero advantage, not NaN
    torch.testing.assert_close(adv[3], torch.full((3,), 5.0 / (1 + 1e-6)))  # singleton: mean 0, std 1
    assert torch.all(adv[4] == 0)  # masked out entirely
    assert adv[5, 0] > 0
    rloo, _ = algos.compute_rloo_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(
        rloo[3], torch.full((3,), 5.0)
    )  # singleton keeps its score (verl's loop version)


def test_zero_length_response_dimension():
    rewards, mask = torch.zeros(4, 0), torch.zeros(4, 0)
    uids = grouped_uids([2, 2])
    for fn in (algos.compute_grpo_outcome_advantage, algos.compute_rloo_outcome_advantage):
        adv, ret = fn(rewards, mask, uids)
        assert adv.shape == (4, 0) and ret.shape == (4, 0)


def test_whitening_estimators_refuse_a_batch_without_two_valid_tokens():
    rewards, values, mask = torch.ones(2, 3), torch.zeros(2, 3), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="selects no element"):
        algos.compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    with pytest.raises(ValueError, match="selects no element"):
        algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 1.0)


def test_uid_arrays_of_any_order_and_kind_give_the_same_groups():
    rewards, _, mask = make_batch(0, "right_padded", "outcome")
    uids = grouped_uids(GROUP_SIZES)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    adv, _ = algos.compute_grpo_outcome_advantage(rewards, mask, uids)
    shuffled, _ = algos.compute_grpo_outcome_advantage(rewards[perm], mask[perm], uids[perm.numpy()])
    torch.testing.assert_close(shuffled, adv[perm])
    as_list, _ = algos.compute_grpo_outcome_advantage(rewards, mask, list(uids))
    as_tensor, _ = algos.compute_grpo_outcome_advantage(
        rewards, mask, torch.as_tensor([int(u.split("-")[1]) for u in uids])
    )
    torch.testing.assert_close(as_list, adv)
    torch.testing.assert_close(as_tensor, adv)


# ---------------------------------------------------------------- bad inputs


def test_shape_mismatch_names_both_tensors():
    with pytest.raises(ValueError, match=r"token_level_rewards \(4, 5\).*response_mask \(4, 6\)"):
        algos.compute_grpo_outcome_advantage(torch.zeros(4, 5), torch.ones(4, 6), grouped_uids([2, 2]))
    with pytest.raises(ValueError, match=r"values \(3, 5\)"):
        algos.compute_gae_advantage_return(torch.zeros(4, 5), torch.zeros(3, 5), torch.ones(4, 5), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"reward_baselines must have shape \(4,\).*\(4, 1\)"):
        algos.compute_remax_outcome_advantage(torch.zeros(4, 5), torch.zeros(4, 1), torch.ones(4, 5))


def test_uid_array_of_wrong_length():
    with pytest.raises(ValueError, match=r"index \(the uid array\) has shape \(3,\), expected \(4,\)"):
        algos.compute_grpo_outcome_advantage(torch.zeros(4, 5), torch.ones(4, 5), grouped_uids([2, 1]))


def test_mixed_uid_kinds_are_refused():
    uids = np.array(["a", 1, "a", 1], dtype=object)
    with pytest.raises(TypeError, match=r"uids of one comparable kind.*\['int', 'str'\]"):
        algos.compute_rloo_outcome_advantage(torch.zeros(4, 5), torch.ones(4, 5), uids)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rewards_name_the_rows(bad):
    rewards = torch.zeros(4, 5)
    rewards[2, 1] = bad
    for call in (
        lambda: algos.compute_grpo_outcome_advantage(rewards, torch.ones(4, 5), grouped_uids([2, 2])),
        lambda: algos.compute_gae_advantage_return(rewards, torch.zeros(4, 5), torch.ones(4, 5), 1.0, 1.0),
        lambda: algos.compute_reinforce_plus_plus_outcome_advantage(rewards, torch.ones(4, 5), 1.0),
    ):
        with pytest.raises(
            ValueError, match=r"token_level_rewards holds NaN or inf in 1 of 4 row\(s\), e.g. rows \[2\]"
        ):
            call()


# ---------------------------------------------------------------- verl itself (optional oracle)


@pytest.mark.parametrize("seed,mask_kind,reward_kind", BATCHES)
def test_estimators_match_verl(verl_core_algos, seed, mask_kind, reward_kind):
    verl = verl_core_algos
    rewards, values, mask = make_batch(seed, mask_kind, reward_kind)
    uids = grouped_uids(GROUP_SIZES)
    baselines = torch.randn(B, generator=torch.Generator().manual_seed(seed))

    class Config(dict):
        gamma = 0.95

    pairs = [
        (
            algos.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95),
            verl.compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95),
        ),
        (
            algos.compute_grpo_outcome_advantage(rewards, mask, uids),
            verl.compute_grpo_outcome_advantage(rewards.clone(), mask, uids),
        ),
        (
            algos.compute_grpo_outcome_advantage(rewards, mask, uids, norm_adv_by_std_in_grpo=False),
            verl.compute_grpo_outcome_advantage(rewards.clone(), mask, uids, norm_adv_by_std_in_grpo=False),
        ),
        (
            algos.compute_rloo_outcome_advantage(rewards, mask, uids),
            verl.compute_rloo_outcome_advantage(rewards.clone(), mask, uids),
        ),
        (
            algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, uids),
            verl.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards.clone(), mask, uids),
        ),
        (
            algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, 0.95),
            verl.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, config=Config()),
        ),
        (
            algos.compute_remax_outcome_advantage(rewards, baselines, mask),
            verl.compute_remax_outcome_advantage(rewards, baselines, mask),
        ),
    ]
    for ours, theirs in pairs:
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b.float(), **TOL)


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64, torch.bfloat16])
def test_mask_dtype_does_not_change_the_result(dtype):
    rewards, values, mask = make_batch(2, "multi_turn", "dense")
    uids = grouped_uids(GROUP_SIZES)
    other = mask.to(dtype)
    for fn, args in (
        (algos.compute_gae_advantage_return, lambda m: (rewards, values, m, 0.9, 0.9)),
        (algos.compute_grpo_outcome_advantage, lambda m: (rewards, m, uids)),
        (algos.compute_reinforce_plus_plus_baseline_outcome_advantage, lambda m: (rewards, m, uids)),
        (algos.compute_reinforce_plus_plus_outcome_advantage, lambda m: (rewards, m, 0.9)),
    ):
        for a, b in zip(fn(*args(mask)), fn(*args(other))):
            torch.testing.assert_close(b.float(), a.float())
