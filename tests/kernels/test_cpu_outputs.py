"""The CPU paths behind large outputs: log-prob gradients and [B, T] advantages written into blocks kept
from an earlier output (csrc/cpu/block_cache.cpp), and the serial row sum / masked broadcast of GRPO."""

import pytest
import torch

from megatron_rl import ops
from megatron_rl.ops import reference

BIG_VOCAB = 16411  # odd: not a multiple of the vector width or the chunk; 67 fp32 rows are over 4 MiB


def log_prob_grad(fn, logits, labels, upstream):
    x = logits.detach().clone().requires_grad_()
    lp, h = fn(x, labels, with_entropy=True)
    ((lp * upstream[0]).sum() + (h * upstream[1]).sum()).backward()
    return lp.detach(), h.detach(), x.grad


@pytest.mark.parametrize("dtype, rows", [(torch.float32, 67), (torch.bfloat16, 131)])
def test_cached_gradient_blocks_are_rewritten_exactly(gen, dtype, rows):
    """Two different batches through one reused block: each gradient matches the reference, including
    labels at the vocabulary's edges and ignored rows (all zero), so nothing of the first batch remains."""
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-5}
    ops.release_cpu_cache()
    ptrs = []
    for step in range(2):
        logits = (torch.randn(rows, BIG_VOCAB, generator=gen) * (3 + step)).to(dtype)
        labels = torch.randint(0, BIG_VOCAB, (rows,), generator=gen)
        labels[::4], labels[1::4] = 0, BIG_VOCAB - 1
        labels[step + 2 :: 9] = -100
        upstream = (torch.randn(rows, generator=gen), torch.randn(rows, generator=gen))
        lp, h, grad = log_prob_grad(ops.log_probs_from_logits, logits, labels, upstream)
        lp_ref, h_ref, grad_ref = log_prob_grad(reference.log_probs_from_logits, logits, labels, upstream)
        torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h, h_ref, rtol=1e-5, atol=1e-5)
        assert grad.dtype == dtype and grad.is_contiguous()
        torch.testing.assert_close(grad, grad_ref, **tol)
        assert not grad[labels == -100].any()
        ptrs.append(grad.data_ptr())
        del grad
    assert ptrs[0] == ptrs[1]  # the second gradient reused the first one's block


def test_release_frees_the_kept_blocks(gen):
    ops.release_cpu_cache()
    values, mask = torch.randn(1100, generator=gen), torch.ones(1100, 1000)  # 4.2 MiB
    out = ops.masked_broadcast(values, mask)
    assert ops.release_cpu_cache() == 0  # still alive: nothing kept
    del out
    assert ops.release_cpu_cache() >= 1100 * 1000 * 4
    assert ops.release_cpu_cache() == 0


@pytest.mark.parametrize("rows, cols", [(0, 5), (3, 0), (1, 1), (5, 17), (9, 1023), (1100, 1000)])
@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_masked_broadcast_matches_torch_bitwise(gen, rows, cols, mask_kind):
    values = torch.randn(rows, generator=gen)
    values[::3] = 0.0
    raw = torch.rand(rows, cols, generator=gen)
    mask = raw > 0.4 if mask_kind == "bool" else torch.where(raw > 0.4, raw * 3, torch.zeros(()))
    expected = values.unsqueeze(-1) * mask
    for _ in range(2):  # the second large output lands in the first one's block
        out = ops.masked_broadcast(values, mask)
        assert out.dtype == expected.dtype == torch.float32 and out.shape == (rows, cols)
        assert torch.equal(out, expected) and torch.equal(out.signbit(), expected.signbit())  # -0.0 as torch
        del out


def test_masked_broadcast_other_inputs_fall_back_to_torch(gen):
    values, mask = torch.randn(4, generator=gen), torch.rand(4, 6, generator=gen)
    for v, m in [(values, mask.double()), (values.double(), mask), (values, mask.t().contiguous().t())]:
        torch.testing.assert_close(ops.masked_broadcast(v, m), v.unsqueeze(-1) * m, rtol=0, atol=0)
    assert ops.masked_broadcast(values, mask.double()).dtype == torch.float64


@pytest.mark.parametrize("rows, cols", [(0, 4), (4, 0), (3, 1), (5, 15), (5, 16), (7, 17), (64, 1000)])
def test_row_sums_match_torch(gen, rows, cols):
    x = torch.randn(rows, cols, generator=gen) * 10
    torch.testing.assert_close(ops.row_sums(x), x.sum(dim=-1), rtol=1e-5, atol=1e-4)
    strided = torch.randn(cols, rows, generator=gen).t()
    torch.testing.assert_close(ops.row_sums(strided), strided.sum(dim=-1), rtol=1e-5, atol=1e-4)
    bf16 = x.bfloat16()
    torch.testing.assert_close(ops.row_sums(bf16), bf16.float().sum(dim=-1), rtol=1e-5, atol=1e-4)


def test_row_sums_keep_non_finite_values():
    x = torch.zeros(3, 40)
    x[0, 33], x[1, 2] = float("nan"), float("inf")
    sums = ops.row_sums(x)
    assert sums[0].isnan() and sums[1] == float("inf") and sums[2] == 0
