"""log_probs_from_logits (compiled CPU kernels) against the plain-torch reference, single rank."""

import pytest
import torch

from megatron_rl import ops
from megatron_rl.ops import reference

FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}

# Both paths upcast the same bf16/fp16 values, so forward results match to fp32 precision; the logits'
# gradient is returned in the logits' dtype and so matches to that dtype's rounding.
GRAD_TOL = {
    torch.float32: FP32_TOL,
    torch.bfloat16: {"rtol": 8e-3, "atol": 1e-5},
    torch.float16: {"rtol": 1e-3, "atol": 1e-6},
    torch.float64: {"rtol": 1e-10, "atol": 1e-12},
}


def run_both(logits, labels, upstream=None, **kw):
    """Forward and backward through ops and reference; returns ((lp, h, grad), (lp, h, grad))."""
    results = []
    for fn in (ops.log_probs_from_logits, reference.log_probs_from_logits):
        x = logits.detach().clone().requires_grad_()
        lp, h = fn(x, labels, with_entropy=True, **kw)
        g_lp, g_h = upstream if upstream is not None else (torch.ones_like(lp), torch.ones_like(h))
        ((lp * g_lp).sum() + (h * g_h).sum()).backward()
        results.append((lp.detach(), h.detach(), x.grad))
    return results


def assert_parity(logits, labels, upstream=None, **kw):
    (lp, h, g), (lp_ref, h_ref, g_ref) = run_both(logits, labels, upstream, **kw)
    assert lp.dtype == (torch.float64 if logits.dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(h, h_ref, **FP32_TOL)
    assert g.dtype == logits.dtype and g.shape == logits.shape
    torch.testing.assert_close(g, g_ref, **GRAD_TOL[logits.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 1000, 4099])  # below one vector, several chunks, odd tail
def test_parity_random(gen, dtype, vocab):
    logits = (torch.randn(37, vocab, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, vocab, (37,), generator=gen)
    upstream = (torch.randn(37, generator=gen), torch.randn(37, generator=gen))
    assert_parity(logits, labels, upstream)


def test_entropy_matches_categorical(gen):
    logits = torch.randn(16, 50, generator=gen) * 3
    _, h = ops.log_probs_from_logits(logits, torch.zeros(16, dtype=torch.long), with_entropy=True)
    torch.testing.assert_close(h, torch.distributions.Categorical(logits=logits).entropy(), **FP32_TOL)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 2.5])
def test_temperature(gen, temperature):
    logits = torch.randn(9, 300, generator=gen)
    labels = torch.randint(0, 300, (9,), generator=gen)
    assert_parity(logits, labels, temperature=temperature)
    lp = ops.log_probs_from_logits(logits, labels, temperature=temperature)
    torch.testing.assert_close(
        lp, torch.log_softmax(logits / temperature, -1)[torch.arange(9), labels], **FP32_TOL
    )


def test_padded_vocab_is_outside_the_softmax(gen):
    logits = torch.randn(6, 64, generator=gen)
    labels = torch.randint(0, 50, (6,), generator=gen)
    padded = logits.clone()
    padded[:, 50:] = 30.0  # would dominate the softmax if it entered it
    lp, h = ops.log_probs_from_logits(padded, labels, with_entropy=True, vocab_size=50)
    lp_real, h_real = ops.log_probs_from_logits(logits[:, :50], labels, with_entropy=True)
    torch.testing.assert_close(lp, lp_real, **FP32_TOL)
    torch.testing.assert_close(h, h_real, **FP32_TOL)
    assert_parity(padded, labels, vocab_size=50)
    x = padded.clone().requires_grad_()
    ops.log_probs_from_logits(x, labels, vocab_size=50).sum().backward()
    assert torch.all(x.grad[:, 50:] == 0)


def test_ignore_index_rows_are_zero_and_get_no_gradient(gen):
    logits = torch.randn(5, 40, generator=gen)
    labels = torch.tensor([3, -100, 7, -100, 39])
    x = logits.clone().requires_grad_()
    lp, h = ops.log_probs_from_logits(x, labels, with_entropy=True)
    (lp.sum() + h.sum()).backward()
    assert torch.all(lp[[1, 3]] == 0) and torch.all(h[[1, 3]] == 0)
    assert torch.all(x.grad[[1, 3]] == 0) and torch.all(x.grad[[0, 2, 4]] != 0)
    assert_parity(logits, labels)
    other = ops.log_probs_from_logits(logits, torch.tensor([3, 5, 7, 5, 39]), ignore_index=5)
    assert other[1] == 0 and other[3] == 0


def test_negative_infinity_logits(gen):
    logits = torch.randn(4, 33, generator=gen)
    logits[0, :10] = float("-inf")  # a masked-out stretch of the vocabulary
    logits[1, ::2] = float("-inf")
    logits[2, 5] = float("-inf")  # the target itself
    labels = torch.tensor([20, 1, 5, 0])
    (lp, h, g), (lp_ref, h_ref, g_ref) = run_both(logits, labels)
    assert lp[2] == float("-inf") and torch.isfinite(lp[[0, 1, 3]]).all()
    torch.testing.assert_close(lp, lp_ref, **FP32_TOL)
    torch.testing.assert_close(h, h_ref, **FP32_TOL)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, g_ref, **FP32_TOL)


def nan_and_inf_problem(gen, vocab, dtype):
    """Rows: NaN off the target, NaN at the target, +inf off the target, +inf at the target, a row all
    -inf, an ordinary row (stays finite)."""
    logits = (torch.randn(6, vocab, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, vocab, (6,), generator=gen)
    labels[0] = (labels[0] + 1) % vocab  # keep the NaN of row 0 off the target
    logits[0, (int(labels[0]) + vocab - 1) % vocab] = float("nan")
    logits[1, labels[1]] = float("nan")
    logits[2, (int(labels[2]) + 1) % vocab] = float("inf")
    logits[3, labels[3]] = float("inf")
    logits[4] = float("-inf")
    upstream = (torch.randn(6, generator=gen), torch.randn(6, generator=gen))
    return logits, labels, upstream


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 1000, 4099])
def test_nan_and_inf_logits_propagate_like_the_reference(gen, dtype, vocab):
    """A NaN (or +inf) logit is a broken model: it must show as NaN in the log-prob, the entropy and the
    whole row's gradient (as torch's log_softmax gives), never be dropped by a max."""
    logits, labels, upstream = nan_and_inf_problem(gen, vocab, dtype)
    (lp, h, g), (lp_ref, h_ref, g_ref) = run_both(logits, labels, upstream)
    assert lp[:5].isnan().all() and h[:5].isnan().all(), (lp, h)
    assert g[:5].isnan().all(), "every gradient of a NaN row is NaN"
    assert torch.isfinite(lp[5]) and torch.isfinite(h[5]) and torch.isfinite(g[5]).all()
    torch.testing.assert_close(lp, lp_ref, equal_nan=True, **FP32_TOL)
    torch.testing.assert_close(h, h_ref, equal_nan=True, **FP32_TOL)
    torch.testing.assert_close(g, g_ref, equal_nan=True, **GRAD_TOL[dtype])


def test_huge_logits(gen):
    logits = torch.randn(8, 500, generator=gen) * 1e4
    logits[0] = 1e4  # a uniform row of huge values: entropy log(500)
    labels = torch.randint(0, 500, (8,), generator=gen)
    (lp, h, g), (lp_ref, h_ref, g_ref) = run_both(logits, labels)
    assert torch.isfinite(lp).all() and torch.isfinite(h).all() and torch.isfinite(g).all()
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref, **FP32_TOL)
    torch.testing.assert_close(h[0], torch.tensor(500.0).log(), **FP32_TOL)
    torch.testing.assert_close(g, g_ref, **FP32_TOL)


def test_batched_and_non_contiguous_inputs(gen):
    full = torch.randn(3, 9, 130, generator=gen)
    labels = torch.randint(0, 120, (3, 9), generator=gen)
    # [B, T, V] with a time slice (reshape must copy), labels sliced too
    lp = ops.log_probs_from_logits(full[:, :-1], labels[:, 1:], vocab_size=120)
    assert lp.shape == (3, 8)
    torch.testing.assert_close(
        lp, reference.log_probs_from_logits(full[:, :-1], labels[:, 1:], vocab_size=120)
    )
    # rows with a stride larger than the row (a column slice): read in place
    assert_parity(full.reshape(27, 130)[:, :100], labels.reshape(27).clamp(max=99))
    # vocabulary dim not contiguous (transposed storage)
    transposed = torch.randn(130, 27, generator=gen).t()
    assert transposed.stride(-1) != 1
    assert_parity(transposed, labels.reshape(27))


def test_int32_labels(gen):
    logits = torch.randn(6, 20, generator=gen)
    labels = torch.randint(0, 20, (6,), generator=gen)
    torch.testing.assert_close(
        ops.log_probs_from_logits(logits, labels.int()), ops.log_probs_from_logits(logits, labels)
    )


@pytest.mark.parametrize("shape", [(0, 11), (2, 0, 11)])
def test_empty_batch(shape):
    x = torch.randn(shape, requires_grad=True)
    lp, h = ops.log_probs_from_logits(x, torch.zeros(shape[:-1], dtype=torch.long), with_entropy=True)
    assert lp.shape == shape[:-1] and h.shape == shape[:-1]
    (lp.sum() + h.sum()).backward()
    assert x.grad.shape == shape


def test_gradient_through_entropy_only(gen):
    logits = torch.randn(5, 30, generator=gen)
    labels = torch.randint(0, 30, (5,), generator=gen)
    upstream = (torch.zeros(5), torch.randn(5, generator=gen))
    assert_parity(logits, labels, upstream)
    x = logits.clone().requires_grad_()
    _, h = ops.log_probs_from_logits(x, labels, with_entropy=True)
    h.sum().backward()  # log-prob output unused: its gradient arrives as None
    torch.testing.assert_close(x.grad.sum(-1), torch.zeros(5), atol=1e-6, rtol=0)


def test_gradcheck_float64(gen):
    logits = torch.randn(6, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 3, -100, 9, 10, 4])  # 10 is padding below, so it is remapped
    labels[4] = 2

    def both(x):
        return ops.log_probs_from_logits(x, labels, with_entropy=True, temperature=0.7, vocab_size=10)

    assert torch.autograd.gradcheck(both, (logits,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(lambda x: ops.log_probs_from_logits(x, labels), (logits,))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"labels": torch.zeros(4, dtype=torch.long)}, ValueError, r"labels shape \(4,\)"),
        ({"labels": torch.zeros(3)}, TypeError, "labels must be int64 or int32"),
        ({"logits": torch.zeros(3, 5, dtype=torch.int64)}, TypeError, "logits must be float32"),
        ({"labels": torch.tensor([0, 5, 1])}, ValueError, r"labels.flatten\(\)\[1\] = 5"),
        ({"labels": torch.tensor([0, -3, 1])}, ValueError, r"labels.flatten\(\)\[1\] = -3"),
        ({"temperature": 0.0}, ValueError, "temperature must be a positive number"),
        ({"vocab_size": 6}, ValueError, r"vocab_size must be in \[1, 5\]"),
        ({"vocab_size": 2}, ValueError, r"labels must be in \[0, 2\)"),
        ({"labels": torch.zeros(3, dtype=torch.long, device="meta")}, ValueError, "one device"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = {"logits": torch.zeros(3, 5), "labels": torch.tensor([0, 4, 1])}
    args.update(kwargs)
    logits, labels = args.pop("logits"), args.pop("labels")
    with pytest.raises(error, match=match):
        ops.log_probs_from_logits(logits, labels, **args)
