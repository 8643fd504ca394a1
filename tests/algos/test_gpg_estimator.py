"""GPG's advantage estimator (algorithm.adv_estimator=gpg, verl's compute_gpg_outcome_advantage): by hand, and
against verl 0.9.1 when MEGATRON_RL_VERL_PATH provides it (tests/algos/conftest.py). Before (issue 37) the name was
unknown and verl's examples/gpg_trainer/run_qwen3_8b_megatron.sh was refused at compose time."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.algos import get_adv_estimator, get_estimator_traits


def rewards_at_last_token(scores: list[float], length: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.zeros(len(scores), length)
    rewards[:, -1] = torch.tensor(scores)
    mask = torch.ones(len(scores), length)
    mask[0, 2:] = 0  # a shorter response: its advantage is masked there
    return rewards, mask


def test_gpg_by_hand():
    # groups a: [1, 0, 0] (mean 1/3), b: [1, 1] (mean 1), c: [0] (a group of one keeps its score)
    rewards, mask = rewards_at_last_token([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    index = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    adv, returns = get_adv_estimator("gpg")(rewards, mask, index)
    alpha = 6 / 3  # 6 responses, 3 with a non-zero score
    expected = alpha * torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv[:, 1], expected)
    assert torch.equal(adv[0, 2:], torch.zeros(2)) and torch.equal(adv, returns)
    assert get_estimator_traits("gpg").needs_groups


def test_gpg_all_zero_scores_divide_by_one():
    rewards, mask = rewards_at_last_token([0.0, 0.0])
    adv, _ = get_adv_estimator("gpg")(rewards, mask, np.array([0, 0]))
    assert torch.equal(adv, torch.zeros_like(adv))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_equals_verl(verl_core_algos, seed):
    g = torch.Generator().manual_seed(seed)
    batch, length = 24, 7
    rewards = torch.zeros(batch, length)
    rewards[:, -1] = torch.randint(0, 3, (batch,), generator=g).float() * torch.rand(batch, generator=g)
    mask = (torch.rand(batch, length, generator=g) > 0.2).float()
    index = np.array([f"p{i}" for i in torch.randint(0, 7, (batch,), generator=g).tolist()], dtype=object)
    ours, _ = get_adv_estimator("gpg")(rewards, mask, index)
    theirs, _ = verl_core_algos.compute_gpg_outcome_advantage(rewards.clone(), mask, index)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
