"""On a GPU: the padded path's SDPA calls run on a fused kernel, never on the math kernel, and the strict
CPU model of torch's backend rules (tests/models/test_attention_dispatch.py) is no more generous than the
real torch (issue 32, items 2 and 17). Skipped without CUDA."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_attention_dispatch import SHAPES, _core, _masks, strict_sdpa_backend  # noqa: E402

from megatron_rl.models import attention  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def _torch_backends(q, k, v, attn_mask, is_causal, enable_gqa) -> set[str]:
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention

    params = SDPAParams(q, k, v, attn_mask, 0.0, is_causal, enable_gqa)
    found = {name for name, fn in (("flash", can_use_flash_attention), ("efficient", can_use_efficient_attention))
             if fn(params, False)}
    try:
        from torch.backends.cuda import can_use_cudnn_attention

        if can_use_cudnn_attention(params, False):
            found.add("cudnn")
    except ImportError:
        pass
    return found


@pytest.mark.parametrize("mask", ["padding", "shared_prompts", "none"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_padded_path_runs_a_fused_kernel_on_cuda(shape, mask):
    heads, kv_heads, dim, window = SHAPES[shape]
    core = _core(heads, kv_heads, dim, window).to(CUDA).train()
    batch, seq = 2, 256
    q = torch.randn(seq, batch, heads, dim, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(seq, batch, kv_heads, dim, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    blocked = _masks(mask, batch, seq)
    blocked = blocked.to(CUDA) if blocked is not None else None
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q_, k_, v_, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        calls.append((q_, k_, v_, attn_mask, is_causal, enable_gqa))
        return real(q_, k_, v_, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = recording
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            core(q, k, v, attention_mask=blocked).float().sum().backward()
    finally:
        F.scaled_dot_product_attention = real
    math_ops = [e.name for e in prof.events() if "_scaled_dot_product_attention_math" in e.name]
    assert not math_ops, f"the math kernel ran: {sorted(set(math_ops))}"
    (call,) = calls
    cq, ck, cv, cmask, causal, gqa = call
    backends = _torch_backends(cq, ck, cv, None if cmask is None else cmask, causal, gqa)
    assert backends, "torch has no fused kernel for the call SDPAttention makes"
    strict = strict_sdpa_backend(sm=torch.cuda.get_device_capability(), dtype=cq.dtype, q_heads=cq.shape[1],
                                 k_heads=ck.shape[1], v_heads=cv.shape[1], head_dim=cq.shape[-1],
                                 has_mask=cmask is not None, is_causal=causal, seq_q=cq.shape[-2],
                                 seq_k=ck.shape[-2], enable_gqa=gqa)
    assert strict == "math" or strict in backends, f"the strict model says {strict}, torch allows {backends}"


def test_varlen_attn_keywords_of_this_torch_are_reported():
    """Which varlen_attn path runs on this machine's torch (item 17): printed for the GPU check's log."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        pytest.skip(f"no varlen_attn in torch {torch.__version__}: {error}")
    keywords = attention.varlen_keywords(varlen_attn)
    plan = attention.varlen_plan(keywords, gqa=True, window=False, default_scale=True)
    print(f"torch {torch.__version__}: varlen_attn keywords {sorted(keywords)} -> {plan.why}")
    assert plan.fused, plan.why
