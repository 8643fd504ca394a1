"""masked_gae and masked_whiten (compiled CPU kernels) against the reference and hand-derived cases."""

import pytest
import torch

from megatron_rl import ops
from megatron_rl.ops import reference

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def random_batch(gen, batch, steps, dtype=torch.float32):
    rewards = torch.randn(batch, steps, generator=gen).to(dtype)
    values = torch.randn(batch, steps, generator=gen).to(dtype)
    mask = torch.rand(batch, steps, generator=gen) > 0.25  # multi-turn style gaps
    return rewards, values, mask


def assert_gae_parity(rewards, values, mask, gamma=0.99, lam=0.95):
    adv, ret = ops.masked_gae(rewards, values, mask, gamma, lam)
    adv_ref, ret_ref = reference.masked_gae(rewards, values, mask, gamma, lam)
    assert adv.dtype == ret.dtype == torch.float32 and adv.shape == rewards.shape
    torch.testing.assert_close(adv, adv_ref, **FP32_TOL)
    torch.testing.assert_close(ret, ret_ref, **FP32_TOL)
    return adv, ret


@pytest.mark.parametrize("batch, steps", [(1, 1), (7, 33), (3, 2500), (64, 16)])
@pytest.mark.parametrize("gamma, lam", [(0.99, 0.95), (1.0, 1.0), (0.0, 0.5)])
def test_gae_parity_random(gen, batch, steps, gamma, lam):
    assert_gae_parity(*random_batch(gen, batch, steps), gamma, lam)


def test_gae_masked_rows_and_gaps(gen):
    rewards, values, mask = random_batch(gen, 6, 40)
    mask[0] = False  # zero-length response
    mask[1, 10:] = False  # right-padded response
    mask[2] = True
    mask[2, 5:9] = False  # an observation span inside a multi-turn response
    adv, ret = assert_gae_parity(rewards, values, mask)
    assert torch.all(adv[0] == 0), "nothing valid: the advantage state never leaves 0"
    torch.testing.assert_close(ret[0], values[0])


def test_gae_telescopes_with_gamma_lam_one():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.5]])
    values = torch.tensor([[0.5, 0.2, 0.1, 0.3]])
    adv, ret = ops.masked_gae(rewards, values, torch.ones(1, 4), 1.0, 1.0)
    # gamma = lam = 1: A_t = sum of rewards from t on - V_t; returns = rewards-to-go
    torch.testing.assert_close(ret, torch.tensor([[1.5, 1.5, 1.5, 0.5]]))
    torch.testing.assert_close(adv, ret - values)


def test_gae_masked_tokens_are_skipped(gen):
    rewards, values, _ = random_batch(gen, 2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[:, 4:7] = False
    adv, _ = ops.masked_gae(rewards, values, mask, 0.9, 0.8)
    keep = mask[0]
    squeezed, _ = ops.masked_gae(rewards[:, keep], values[:, keep], torch.ones(2, int(keep.sum())), 0.9, 0.8)
    torch.testing.assert_close(adv[:, keep], squeezed, **FP32_TOL)
    torch.testing.assert_close(adv[:, 4:7], adv[:, 7:8].expand(2, 3))  # carried through unchanged


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32, torch.bfloat16])
def test_gae_mask_dtypes_and_bf16_inputs(gen, mask_dtype):
    rewards, values, mask = random_batch(gen, 4, 30, dtype=torch.bfloat16)
    assert_gae_parity(rewards, values, mask.to(mask_dtype))


def test_gae_non_contiguous_and_empty(gen):
    rewards, values, mask = random_batch(gen, 5, 20)
    assert_gae_parity(rewards.t().contiguous().t(), values[:, ::1], mask.t().contiguous().t())
    adv, ret = ops.masked_gae(torch.zeros(0, 5), torch.zeros(0, 5), torch.zeros(0, 5), 0.9, 0.9)
    assert adv.shape == ret.shape == (0, 5)
    adv, _ = ops.masked_gae(torch.zeros(3, 0), torch.zeros(3, 0), torch.zeros(3, 0), 0.9, 0.9)
    assert adv.shape == (3, 0)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 0.9, 0.9), r"values \(2, 4\)"),
        ((torch.zeros(6), torch.zeros(6), torch.ones(6), 0.9, 0.9), r"must be \[B, T\]"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.5, 0.9), "gamma must be a number in"),
        ((torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 0.9, -0.1), "lam must be a number in"),
    ],
)
def test_gae_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        ops.masked_gae(*args)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_parity(gen, shift_mean):
    x = torch.randn(16, 300, generator=gen) * 3 + 2
    mask = torch.rand(16, 300, generator=gen) > 0.3
    out = ops.masked_whiten(x, mask, shift_mean=shift_mean)
    torch.testing.assert_close(out, reference.masked_whiten(x, mask, shift_mean=shift_mean), **FP32_TOL)
    valid = out[mask]
    expected_mean = reference.masked_mean(x, mask) if not shift_mean else torch.tensor(0.0)
    torch.testing.assert_close(valid.mean(), expected_mean, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(valid.std(), torch.tensor(1.0), rtol=1e-4, atol=1e-4)


def test_whiten_ignores_nan_outside_mask(gen):
    x = torch.randn(4, 10, generator=gen)
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[:, -2:] = False
    x[:, -2:] = float("nan")
    out = ops.masked_whiten(x, mask)
    assert torch.isfinite(out[mask]).all()
    torch.testing.assert_close(out[mask], reference.masked_whiten(x, mask)[mask], **FP32_TOL)


@pytest.mark.parametrize("n_valid, match", [(0, "selects no element"), (1, "selects one element")])
def test_whiten_needs_two_valid_elements(n_valid, match):
    mask = torch.zeros(3, 4)
    mask.view(-1)[:n_valid] = 1
    with pytest.raises(ValueError, match=match):
        ops.masked_whiten(torch.randn(3, 4), mask)
    with pytest.raises(ValueError, match=match):
        reference.masked_whiten(torch.randn(3, 4), mask)


def test_whiten_shape_mismatch():
    with pytest.raises(ValueError, match=r"x shape \(3, 4\) and mask shape \(3, 5\)"):
        ops.masked_whiten(torch.randn(3, 4), torch.ones(3, 5))


def test_masked_mean(gen):
    x = torch.randn(5, 6, generator=gen)
    mask = torch.rand(5, 6, generator=gen) > 0.5
    mask[0] = True
    torch.testing.assert_close(ops.masked_mean(x, mask), x[mask].mean(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ops.masked_mean(x, mask, dim=-1)[0], x[0].mean())
