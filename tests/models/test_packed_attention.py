"""Packed (THD) attention: which kernel runs where, and the fused flash-varlen call's arguments.

The fused kernel (torch's ``varlen_attn``, flash attention's cu_seqlens kernel) exists on CUDA only; here a
stand-in with its contract (int32 cu_seqlens on the query's device, (T, H, D) q/k/v, window (left, right)
with (-1, 0) meaning causal, GQA only when asked for, no dropout) computes the block-diagonal attention
with one dense mask, independently of the per-sequence twin, and both must give the padded path's numbers.
The real kernel is run by tests/gpu/test_megatron_cuda.py on a lent GPU."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models import attention
from megatron_rl.models.attention import FLASH_VARLEN, SDPA_PER_SEQUENCE, SDPAttention, packed_attention_kernel

HEADS, KV_HEADS, DIM = 4, 2, 8
LENGTHS = (5, 1, 7, 3)


def _core(window: int | None) -> SDPAttention:
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, kv_channels=DIM, attention_dropout=0.0,
                               window_size=(window, 0) if window is not None else None)
    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").eval()


def _packed_inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, DIM, generator=gen)
    k, v = (torch.randn(total, KV_HEADS, DIM, generator=gen) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
    return q, k, v, params


def strict_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                       window_size=(-1, -1), enable_gqa=False, **unused):
    """varlen_attn's contract, enforced, computed as one dense block-diagonal mask."""
    assert not unused, f"unexpected arguments {sorted(unused)}"
    assert cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32, "flash needs int32 cu_seqlens"
    assert cu_seq_q.device == query.device, "cu_seqlens must be on the query's device"
    assert query.dim() == 3 and key.dim() == 3, "varlen_attn takes (T, H, D)"
    if query.shape[1] != key.shape[1]:
        assert enable_gqa, "fewer kv heads than query heads needs enable_gqa=True"
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    assert max_q == max_k == max(lengths), (max_q, max_k, lengths)
    left, right = window_size
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(query.shape[0])
    distance = pos[:, None] - pos[None, :]
    allowed = seq_id[:, None] == seq_id[None, :]
    if right >= 0:
        allowed &= distance >= -right
    if left >= 0:
        allowed &= distance <= left
    q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=enable_gqa)
    return out.squeeze(0).permute(1, 0, 2)


def _padded_reference(core: SDPAttention, q, k, v) -> torch.Tensor:
    """Each sequence alone through the padded (dense-mask) path of the same core."""
    outs, start = [], 0
    for length in LENGTHS:
        piece = [t[start:start + length].unsqueeze(1) for t in (q, k, v)]  # [s, 1, h, d]
        mask = attention.causal_padding_mask(torch.ones(1, length, dtype=torch.long))
        outs.append(core(*piece, attention_mask=mask).squeeze(1))
        start += length
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 2])
def test_fused_varlen_call_and_per_sequence_twin_equal_the_padded_path(monkeypatch, window):
    import torch.nn.attention.varlen as varlen

    core = _core(window)
    q, k, v, params = _packed_inputs()
    expected = _padded_reference(core, q, k, v)
    twin = core(q, k, v, attention_mask=None, packed_seq_params=params)
    torch.testing.assert_close(twin, expected, atol=1e-6, rtol=0)

    calls = []

    @functools.wraps(strict_varlen_attn)  # the stand-in's signature is what SDPAttention detects (item 17)
    def recording(*args, **kwargs):
        calls.append(kwargs)
        return strict_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", recording)
    monkeypatch.setattr(attention, "packed_attention_kernel", lambda query, dropout: (FLASH_VARLEN, "forced"))
    fused = core(q, k, v, attention_mask=None, packed_seq_params=params)
    assert len(calls) == 1, "one fused call for the whole pack, not one per sequence"
    assert calls[0]["window_size"] == ((window, 0) if window is not None else (-1, 0))
    assert calls[0]["scale"] == pytest.approx(DIM ** -0.5)
    torch.testing.assert_close(fused, expected, atol=1e-6, rtol=0)


def test_fused_call_gets_int32_cu_seqlens_even_from_int64(monkeypatch):
    import torch.nn.attention.varlen as varlen

    core = _core(None)
    q, k, v, params = _packed_inputs(seed=1)
    params.cu_seqlens_q = params.cu_seqlens_kv = params.cu_seqlens_q.long()
    monkeypatch.setattr(varlen, "varlen_attn", strict_varlen_attn)
    monkeypatch.setattr(attention, "packed_attention_kernel", lambda query, dropout: (FLASH_VARLEN, "forced"))
    torch.testing.assert_close(core(q, k, v, attention_mask=None, packed_seq_params=params),
                               _padded_reference(core, q, k, v), atol=1e-6, rtol=0)


@pytest.mark.parametrize(("device", "dtype", "dropout", "kernel", "reason"), [
    ("cuda", torch.bfloat16, 0.0, FLASH_VARLEN, "CUDA"),
    ("cuda", torch.float16, 0.0, FLASH_VARLEN, "CUDA"),
    ("cuda", torch.float32, 0.0, SDPA_PER_SEQUENCE, "float32"),
    ("cuda", torch.bfloat16, 0.1, SDPA_PER_SEQUENCE, "attention_dropout=0.1"),
    ("cpu", torch.bfloat16, 0.0, SDPA_PER_SEQUENCE, "CUDA-only"),
])
def test_kernel_choice_names_its_reason(device, dtype, dropout, kernel, reason):
    query = SimpleNamespace(is_cuda=device == "cuda", dtype=dtype, device=torch.device(device))
    chosen, why = packed_attention_kernel(query, dropout)
    assert chosen == kernel and reason in why, (chosen, why)


def test_unequal_cu_seqlens_are_refused():
    core = _core(None)
    q, k, v, params = _packed_inputs()
    params.cu_seqlens_kv = params.cu_seqlens_kv.clone()
    params.cu_seqlens_kv[1] += 1
    with pytest.raises(ValueError, match="cu_seqlens_q == cu_seqlens_kv"):
        core(q, k, v, attention_mask=None, packed_seq_params=params)
