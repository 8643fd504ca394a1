"""``preference_pair_loss`` (algos/preference.py): rows in any order are paired by pair_index / chosen, the loss is
``compute_preference_loss``'s on the pairs, and each row's derivative is DPO's closed form; broken pairings refused."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.algos.preference import compute_preference_loss, preference_pair_loss


def test_shuffled_rows_give_the_paired_loss_and_dpo_closed_form_derivatives():
    gen = torch.Generator().manual_seed(0)
    policy, reference = torch.randn(8, generator=gen) * 3, torch.randn(8, generator=gen) * 3
    pair_index, chosen = torch.arange(4).repeat_interleave(2), torch.tensor([1, 0] * 4)
    perm = torch.randperm(8, generator=gen)
    loss, metrics, grad = preference_pair_loss(policy[perm], reference[perm], pair_index[perm], chosen[perm],
                                               loss_type="sigmoid", beta=0.3)
    expected, expected_metrics = compute_preference_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2],
                                                         loss_type="sigmoid", beta=0.3)
    assert loss == pytest.approx(float(expected), rel=1e-6)
    assert metrics["rewards/margins"] == pytest.approx(expected_metrics["rewards/margins"], rel=1e-6)
    # dL/d pi_c = -beta sigma(-beta h) / P, dL/d pi_r = +beta sigma(-beta h) / P
    h = (policy[0::2] - reference[0::2]) - (policy[1::2] - reference[1::2])
    weight = 0.3 * torch.sigmoid(-0.3 * h) / 4
    closed = torch.stack([-weight, weight], dim=1).flatten()
    torch.testing.assert_close(grad, closed[perm], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("pair_index, chosen", [
    ([0, 0, 1], [1, 0, 1]),  # a side missing
    ([0, 0, 1, 1], [1, 1, 1, 0]),  # two chosen sides
    ([0, 0, 0, 0], [1, 0, 1, 0]),  # a pair index twice over
])
def test_a_broken_pairing_is_refused(pair_index, chosen):
    logps = torch.zeros(len(pair_index))
    with pytest.raises(ValueError, match="each pair_index exactly twice"):
        preference_pair_loss(logps, logps, torch.tensor(pair_index), torch.tensor(chosen))
