"""The extension as torch sees it: op registration (schemas, fake kernels), the reference fallback,
and the baseline-ISA CPU kernels that machines without AVX2 run."""

import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megatron_rl
from megatron_rl import ops
from megatron_rl.ops import _extension, reference


def op_samples():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, generator=gen)
    labels = torch.tensor([0, 3, -100, 11, 7])
    stats = torch.ops.megatron_rl.log_prob_stats(logits, labels, 0, 12, 1.0, -100)
    _lp, h, row_max, log_sum = torch.ops.megatron_rl.log_prob_merge(stats[None], labels, -100)
    rewards, mask = torch.randn(3, 9, generator=gen), torch.ones(3, 9)
    scores, groups = torch.randn(6, generator=gen), torch.tensor([0, 0, 1, 1, 1, 2])
    return [
        ("log_prob_stats", (logits, labels, 0, 12, 1.0, -100)),
        ("log_prob_merge", (stats[None], labels, -100)),
        ("log_prob_backward", (logits, labels, row_max, log_sum, h, torch.ones(5), None, 0, 12, 1.0, -100)),
        ("masked_gae", (rewards, rewards, mask, 0.99, 0.95)),
        ("masked_whiten", (rewards, mask, True)),
        ("group_normalize", (scores, groups, 3, "grpo", 1e-6)),
        ("masked_broadcast", (scores[:3], mask)),
        ("row_sums", (rewards,)),
    ]


@pytest.mark.parametrize("index", range(8))
def test_op_registration(index):
    name, args = op_samples()[index]
    torch.library.opcheck(
        getattr(torch.ops.megatron_rl, name), args, test_utils=("test_schema", "test_faketensor")
    )


def test_log_probs_trace_under_fake_tensors():
    with FakeTensorMode():
        logits = torch.empty(4, 7, 32, requires_grad=True)
        labels = torch.zeros(4, 7, dtype=torch.long)
        lp, h = ops.log_probs_from_logits(logits, labels, with_entropy=True)
        (lp.sum() + h.sum()).backward()
        assert lp.shape == h.shape == (4, 7) and logits.grad.shape == logits.shape


def test_fallback_to_reference_warns_once(monkeypatch):
    monkeypatch.setattr(_extension, "_load", lambda: None)
    gen = torch.Generator().manual_seed(3)
    logits, labels = torch.randn(4, 10, generator=gen), torch.tensor([1, 2, 3, 4])
    rewards, mask = torch.randn(2, 5, generator=gen), torch.ones(2, 5)
    _extension._warn_no_kernels_for.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the patched loader must not be reached by a real import
        torch.testing.assert_close(
            ops.log_probs_from_logits(logits, labels), reference.log_probs_from_logits(logits, labels)
        )
        torch.testing.assert_close(
            ops.masked_gae(rewards, rewards, mask, 0.9, 0.9),
            reference.masked_gae(rewards, rewards, mask, 0.9, 0.9),
        )


def test_missing_extension_warns_once(monkeypatch):
    _extension._load.cache_clear()
    monkeypatch.delattr(megatron_rl, "_C", raising=False)
    monkeypatch.setitem(sys.modules, "megatron_rl._C", None)  # makes `from megatron_rl import _C` fail
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            ops.log_probs_from_logits(torch.randn(2, 4), torch.tensor([0, 1]))
            ops.group_normalize(torch.randn(2), torch.tensor([0, 1]), mode="grpo")
        missing = [w for w in record if "megatron_rl._C is not available" in str(w.message)]
        assert len(missing) == 1 and missing[0].category is RuntimeWarning
        assert ops.backend_summary().startswith("plain-torch reference")
    finally:
        _extension._load.cache_clear()


def test_cuda_tensors_without_cuda_kernels_fall_back(monkeypatch):
    monkeypatch.setattr(_extension, "_load", lambda: types.SimpleNamespace(cuda_compiled=False))
    _extension._warn_no_kernels_for.cache_clear()
    on_cuda = types.SimpleNamespace(device=torch.device("cuda"))  # only the device is looked at
    with pytest.warns(RuntimeWarning, match="has no cuda kernels"):
        assert _extension.kernels_for(on_cuda) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is enough
        assert _extension.kernels_for(on_cuda) is None
        assert _extension.kernels_for(torch.empty(1)) is torch.ops.megatron_rl
    _extension._warn_no_kernels_for.cache_clear()


def test_baseline_isa_kernels_match_reference():
    """ATEN_CPU_CAPABILITY=default makes the extension use its non-AVX2 build, as on older CPUs."""
    script = textwrap.dedent(
        """
        import torch, megatron_rl.ops as ops
        from megatron_rl import _C
        from megatron_rl.ops import reference
        assert _C.cpu_isa() == "default", _C.cpu_isa()
        g = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(9, 2100, generator=g) * 3).to(dtype).requires_grad_()
            y = torch.randint(0, 2000, (9,), generator=g)
            lp, h = ops.log_probs_from_logits(x, y, with_entropy=True, vocab_size=2000)
            (lp.sum() + h.sum()).backward()
            x2 = x.detach().clone().requires_grad_()
            lr, hr = reference.log_probs_from_logits(x2, y, with_entropy=True, vocab_size=2000)
            (lr.sum() + hr.sum()).backward()
            torch.testing.assert_close(lp, lr, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(h, hr, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(x.grad.float(), x2.grad.float(), rtol=8e-3, atol=1e-5)
        print("ok")
        """
    )
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
