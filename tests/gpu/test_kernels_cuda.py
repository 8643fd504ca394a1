"""The CUDA kernels against the plain-torch reference (same device). Skipped without CUDA.

Sizes are chosen to reach every code path: 16-byte aligned rows and unaligned rows (scalar path),
padded vocabularies, one-segment and multi-segment GAE scans with 4 and 1 tokens per thread.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from megatron_rl import ops
from megatron_rl.ops import reference

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {
    torch.float32: FP32_TOL,
    torch.bfloat16: {"rtol": 8e-3, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-6},
}


@pytest.fixture(autouse=True, scope="module")
def cuda_kernels():
    if "cuda" not in ops.backend_summary():
        pytest.fail(
            f"megatron_rl._C has no CUDA kernels ({ops.backend_summary()}): build with MEGATRON_RL_BUILD_CUDA=1"
        )


@pytest.fixture
def gen():
    return torch.Generator(device=CUDA).manual_seed(99)


def log_prob_results(fn, logits, labels, upstream, **kw):
    x = logits.detach().clone().requires_grad_()
    lp, h = fn(x, labels, with_entropy=True, **kw)
    ((lp * upstream[0]).sum() + (h * upstream[1]).sum()).backward()
    return lp.detach(), h.detach(), x.grad


def assert_log_prob_parity(logits, labels, **kw):
    rows = labels.numel()
    upstream = (torch.randn(rows, device=CUDA), torch.randn(rows, device=CUDA))
    lp, h, g = log_prob_results(ops.log_probs_from_logits, logits, labels, upstream, **kw)
    lp_ref, h_ref, g_ref = log_prob_results(reference.log_probs_from_logits, logits, labels, upstream, **kw)
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(h, h_ref, **FP32_TOL)
    assert g.dtype == logits.dtype
    torch.testing.assert_close(g, g_ref, **GRAD_TOL[logits.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [8, 1000, 4096, 4099, 32000])  # 4099: most rows start unaligned
def test_log_prob_parity(gen, dtype, vocab):
    logits = (torch.randn(67, vocab, device=CUDA, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, vocab, (67,), device=CUDA, generator=gen)
    labels[5] = -100
    assert_log_prob_parity(logits, labels)


def test_log_prob_padding_temperature_and_strided_rows(gen):
    full = torch.randn(40, 5200, device=CUDA, generator=gen).bfloat16()
    labels = torch.randint(0, 5000, (40,), device=CUDA, generator=gen)
    assert_log_prob_parity(full, labels, vocab_size=5000, temperature=0.7)
    assert_log_prob_parity(full[:, 8:5128], labels, vocab_size=5000)  # row stride 5200, offset start


def test_log_prob_adversarial_rows(gen):
    logits = torch.randn(6, 2048, device=CUDA, generator=gen)
    logits[0, :1000] = float("-inf")
    logits[1] = 1e4
    logits[2] *= 1e4
    logits[3, 17] = float("-inf")
    labels = torch.tensor([1500, 3, 9, 17, -100, 0], device=CUDA)
    lp, h = ops.log_probs_from_logits(logits, labels, with_entropy=True)
    assert lp[3] == float("-inf") and lp[4] == 0 and h[4] == 0
    torch.testing.assert_close(h[1], torch.tensor(2048.0, device=CUDA).log(), **FP32_TOL)
    keep = torch.tensor([0, 1, 2, 4, 5], device=CUDA)
    assert_log_prob_parity(logits[keep], labels[keep])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [8, 4099, 32000])  # one pack; unaligned rows; many packs per thread
def test_log_prob_nan_and_inf_propagate(gen, dtype, vocab):
    """fmax drops NaN: before issue 32 the CUDA kernel returned finite log-probs and gradients for a row
    with a NaN logit. Rows: NaN off / at the target, +inf off / at the target, all -inf, an ordinary row;
    the NaN placed first, in the middle and last of the row (pack order and the block merge both matter)."""
    rows = 12
    logits = (torch.randn(rows, vocab, device=CUDA, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (rows,), device=CUDA, generator=gen)
    for r, col in enumerate((0, vocab // 2, vocab - 1)):
        labels[r] = (col + 1) % vocab
        logits[r, col] = float("nan")
    logits[3, labels[3]] = float("nan")
    logits[4, (int(labels[4]) + 1) % vocab] = float("inf")
    logits[5, labels[5]] = float("inf")
    logits[6] = float("-inf")
    upstream = (torch.randn(rows, device=CUDA), torch.randn(rows, device=CUDA))
    lp, h, g = log_prob_results(ops.log_probs_from_logits, logits, labels, upstream)
    lp_ref, h_ref, g_ref = log_prob_results(reference.log_probs_from_logits, logits, labels, upstream)
    assert lp[:7].isnan().all() and h[:7].isnan().all(), (lp, h)
    assert g[:7].isnan().all(), "every gradient of a NaN row is NaN"
    assert torch.isfinite(lp[7:]).all() and torch.isfinite(g[7:]).all()
    torch.testing.assert_close(lp, lp_ref, equal_nan=True, **FP32_TOL)
    torch.testing.assert_close(h, h_ref, equal_nan=True, **FP32_TOL)
    torch.testing.assert_close(g, g_ref, equal_nan=True, **GRAD_TOL[dtype])


def test_log_prob_large_vocab(gen):
    logits = torch.randn(64, 152064, device=CUDA, generator=gen).bfloat16()
    labels = torch.randint(0, 151936, (64,), device=CUDA, generator=gen)
    assert_log_prob_parity(logits, labels, vocab_size=151936)


def test_log_prob_gradcheck_float64(gen):
    logits = torch.randn(5, 37, device=CUDA, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.tensor([0, 36, -100, 20, 7], device=CUDA)
    assert torch.autograd.gradcheck(
        lambda x: ops.log_probs_from_logits(x, labels, with_entropy=True, temperature=1.3), (logits,)
    )


def test_log_prob_empty():
    x = torch.randn(0, 100, device=CUDA, requires_grad=True)
    lp = ops.log_probs_from_logits(x, torch.zeros(0, dtype=torch.long, device=CUDA))
    lp.sum().backward()
    assert lp.shape == (0,) and x.grad.shape == (0, 100)


@pytest.mark.parametrize("batch, steps", [(3, 200), (1024, 100), (256, 2048), (2, 5000), (1, 70000)])
def test_gae_parity(gen, batch, steps):
    rewards = torch.randn(batch, steps, device=CUDA, generator=gen)
    values = torch.randn(batch, steps, device=CUDA, generator=gen)
    mask = torch.rand(batch, steps, device=CUDA, generator=gen) > 0.2
    mask[0] = False  # a zero-length response
    adv, ret = ops.masked_gae(rewards, values, mask, 0.99, 0.95)
    adv_ref, ret_ref = reference.masked_gae(rewards.cpu(), values.cpu(), mask.cpu(), 0.99, 0.95)
    # the scan re-associates the recurrence: fp32 rounding differs from the sequential loop
    torch.testing.assert_close(adv.cpu(), adv_ref, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(ret.cpu(), ret_ref, rtol=1e-5, atol=5e-5)


def test_whiten_parity_and_errors(gen):
    x = torch.randn(300, 700, device=CUDA, generator=gen) * 2 + 1
    mask = torch.rand(300, 700, device=CUDA, generator=gen) > 0.3
    for shift_mean in (True, False):
        torch.testing.assert_close(
            ops.masked_whiten(x, mask, shift_mean), reference.masked_whiten(x, mask, shift_mean), **FP32_TOL
        )
    one_valid = torch.zeros(3, 4, device=CUDA)
    one_valid[1, 2] = 1
    with pytest.raises(ValueError, match="selects one element"):
        ops.masked_whiten(torch.randn(3, 4, device=CUDA), one_valid)


@pytest.mark.parametrize("mode", ["grpo", "grpo_mean", "rloo"])
@pytest.mark.parametrize("groups, size", [(3, 3), (1024, 8192), (256, 16384)])
def test_group_normalize_parity(gen, mode, groups, size):
    scores = (torch.rand(size, device=CUDA, generator=gen) > 0.5).float() + torch.randn(
        size, device=CUDA, generator=gen
    )
    group_index = torch.randperm(size, device=CUDA, generator=gen) % groups
    torch.testing.assert_close(
        ops.group_normalize(scores, group_index, mode=mode),
        reference.group_normalize(scores, group_index, mode=mode),
        **FP32_TOL,
    )
