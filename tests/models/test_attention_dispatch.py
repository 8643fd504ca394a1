"""Which kernel SDPA picks for the calls SDPAttention makes on CUDA, judged on CPU by a STRICT model of
torch's backend rules, and which varlen_attn call runs for the torch at hand (issue 32, items 2 and 17).

The model follows aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (``can_use_flash_attention``,
``can_use_mem_efficient_attention``, ``select_sdp_backend``) and is strict where torch releases differ:
mem-efficient is taken to need as many K/V heads as query heads (torch before it learned GQA), and cuDNN's
attention (preferred only with some cuDNN versions and GPUs; refused in deterministic mode) is not counted on.
A call it sends to ``math`` would store fp32 [heads, s, s] probabilities per layer on a GPU.
tests/gpu/test_attention_dispatch_cuda.py asks the real torch on a lent GPU."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.models import attention
from megatron_rl.models.attention import SDPAttention, causal_padding_mask, shared_prompt_mask

HALF = (torch.float16, torch.bfloat16)


def strict_sdpa_backend(*, sm: tuple[int, int], dtype, q_heads: int, k_heads: int, v_heads: int, head_dim: int,
                        has_mask: bool, is_causal: bool, seq_q: int, seq_k: int, enable_gqa: bool) -> str:
    """flash | efficient | math | error, for dense contiguous [b, h, s, d] CUDA inputs, default priorities."""
    same_heads = q_heads == k_heads == v_heads
    gqa_ok = enable_gqa and k_heads == v_heads and q_heads % k_heads == 0
    if not same_heads and not gqa_ok:
        return "error"  # no backend, math included, takes unequal heads without enable_gqa
    sm_ok = (8, 0) <= sm <= (12, 1)
    flash = (sm_ok and not has_mask and dtype in HALF and head_dim <= 256
             and not (is_causal and seq_q != seq_k) and (same_heads or gqa_ok))
    if flash:
        return "flash"
    alignment = 8 if (dtype in HALF and sm >= (8, 0)) else 4
    efficient_dtypes = (torch.float16, torch.float32, torch.bfloat16) if sm >= (8, 0) else (torch.float16, torch.float32)
    efficient = ((5, 0) <= sm <= (12, 1) and dtype in efficient_dtypes and head_dim % alignment == 0
                 and same_heads)  # strict: mem-efficient without GQA
    return "efficient" if efficient else "math"


def test_the_strict_model_holds_torchs_documented_rules():
    common = dict(sm=(9, 0), dtype=torch.bfloat16, head_dim=128, seq_q=64, seq_k=64)
    # flash takes no mask; mem-efficient does, with equal heads
    assert strict_sdpa_backend(**common, q_heads=8, k_heads=8, v_heads=8, has_mask=True, is_causal=False,
                               enable_gqa=False) == "efficient"
    # GQA without a mask: flash
    assert strict_sdpa_backend(**common, q_heads=8, k_heads=1, v_heads=1, has_mask=False, is_causal=True,
                               enable_gqa=True) == "flash"
    # GQA with a mask (the padded path before issue 32): math
    assert strict_sdpa_backend(**common, q_heads=8, k_heads=1, v_heads=1, has_mask=True, is_causal=False,
                               enable_gqa=True) == "math"
    # fp32: no flash; head_dim 100 in bf16: no mem-efficient
    assert strict_sdpa_backend(**{**common, "dtype": torch.float32}, q_heads=8, k_heads=8, v_heads=8,
                               has_mask=False, is_causal=True, enable_gqa=False) == "efficient"
    assert strict_sdpa_backend(**{**common, "head_dim": 100}, q_heads=8, k_heads=8, v_heads=8,
                               has_mask=True, is_causal=False, enable_gqa=False) == "math"
    assert strict_sdpa_backend(**common, q_heads=8, k_heads=2, v_heads=2, has_mask=False, is_causal=True,
                               enable_gqa=False) == "error"


class SdpaRecorder:
    """Records every F.scaled_dot_product_attention call (its arguments as SDPA's dispatcher sees them)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.real = F.scaled_dot_product_attention

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        self.calls.append(dict(dtype=q.dtype, q_heads=q.shape[1], k_heads=k.shape[1], v_heads=v.shape[1],
                               head_dim=q.shape[-1], has_mask=attn_mask is not None, is_causal=is_causal,
                               seq_q=q.shape[-2], seq_k=k.shape[-2], enable_gqa=enable_gqa))
        return self.real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa)


def _core(heads: int, kv_heads: int, dim: int, window: int | None = None) -> SDPAttention:
    config = TransformerConfig(num_layers=1, hidden_size=heads * dim, num_attention_heads=heads,
                               num_query_groups=kv_heads, kv_channels=dim, attention_dropout=0.0,
                               window_size=(window, 0) if window is not None else None)
    return SDPAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self").eval()


def _as_if_on_cuda(monkeypatch):
    """The padded path plans its call as on a CUDA device (the plan is all that depends on the device)."""
    real = attention.padded_attention_plan
    monkeypatch.setattr(attention, "padded_attention_plan", lambda **kw: real(**{**kw, "on_cuda": True}))


def _masks(kind: str, batch: int, seq: int):
    gen = torch.Generator().manual_seed(0)
    if kind == "none":
        return None
    if kind == "padding":
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=gen)
        return causal_padding_mask((torch.arange(seq)[None, :] < lengths[:, None]).long())
    segments = torch.full((batch, seq), attention.PROMPT_SEGMENT)  # shared prompts: [prompt | r0 | r1 | pad]
    segments[:, seq // 2 : 3 * seq // 4] = 0
    segments[:, 3 * seq // 4 : -2] = 1
    segments[:, -2:] = attention.PAD_SEGMENT
    return shared_prompt_mask(segments)


# 70B at TP=8: 8 query heads, 1 K/V head per rank, head_dim 128; 7B (Qwen2.5) at TP=4: 7 and 1; MHA; Mistral.
SHAPES = {"llama70b_tp8": (8, 1, 128, None), "qwen7b_tp4": (7, 1, 128, None), "mha": (4, 4, 64, None),
          "mistral_window": (8, 2, 128, 5)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mask", ["padding", "shared_prompts", "none"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_padded_path_never_falls_back_to_the_math_kernel_on_cuda(monkeypatch, shape, mask, dtype):
    heads, kv_heads, dim, window = SHAPES[shape]
    core = _core(heads, kv_heads, dim, window)
    batch, seq = 2, 16
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(seq, batch, heads, dim, generator=gen).to(dtype)
    k, v = (torch.randn(seq, batch, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    blocked = _masks(mask, batch, seq)
    expected = core(q, k, v, attention_mask=blocked)  # CPU plan: enable_gqa, no K/V copies
    recorder = SdpaRecorder()
    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    _as_if_on_cuda(monkeypatch)
    out = core(q, k, v, attention_mask=blocked)
    assert len(recorder.calls) == 1
    backend = strict_sdpa_backend(sm=(9, 0), **recorder.calls[0])
    assert backend in ("flash", "efficient"), f"{recorder.calls[0]} -> {backend}"
    if dtype in HALF and mask == "none" and window is None:
        assert backend == "flash"
    torch.testing.assert_close(out, expected, atol=1e-2 if dtype in HALF else 1e-6, rtol=0)


@pytest.mark.parametrize("window", [None, 3])
def test_per_sequence_twin_never_falls_back_to_the_math_kernel_on_cuda(monkeypatch, window):
    """The THD fallback (fp32, dropout, no fused varlen): one SDPA call per sequence, a mask for a window."""
    core = _core(8, 2, 64, window)
    lengths = (5, 7)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lengths), 8, 64, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 64, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    expected = core(q, k, v, attention_mask=None, packed_seq_params=params)
    recorder = SdpaRecorder()
    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    _as_if_on_cuda(monkeypatch)
    out = core(q, k, v, attention_mask=None, packed_seq_params=params)
    assert len(recorder.calls) == 2
    for call in recorder.calls:
        assert strict_sdpa_backend(sm=(9, 0), **call) in ("flash", "efficient"), call
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_the_planner_counts_the_kernel_that_runs():
    """plan.memory asks the same plan the model uses; the math kernel would be counted too."""
    from megatron_rl.plan import memory

    common = dict(on_cuda=True, dtype=torch.bfloat16, q_heads=8, kv_heads=1, head_dim=128)
    assert attention.padded_attention_plan(**common, masked=True).kernel == attention.SDPA_EFFICIENT_EXPANDED_KV
    assert memory.attention_kernel(packed=True, shared_prompts=False, dtype="bf16", dropout=0.0,
                                   q_heads=64, kv_heads=8, head_dim=128, tp=8) == attention.FLASH_VARLEN
    assert memory.attention_kernel(packed=False, shared_prompts=False, dtype="bf16", dropout=0.0,
                                   q_heads=64, kv_heads=8, head_dim=128, tp=8) == attention.SDPA_EFFICIENT_EXPANDED_KV


# ------------------------------------------------------------------------------------------ item 17: varlen_attn
def varlen_full(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    raise AssertionError("signature only")


def varlen_old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
    """An older varlen_attn: causal flag, no scale, no window, no GQA."""
    assert query.shape[1] == key.shape[1] == value.shape[1], "this varlen_attn has no GQA"
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    seq_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(query.shape[0])
    allowed = (seq_id[:, None] == seq_id[None, :]) & ((pos[:, None] >= pos[None, :]) | (not is_causal))
    q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).squeeze(0).permute(1, 0, 2)


def test_varlen_keywords_are_detected_from_the_signature():
    assert attention.varlen_keywords(varlen_full) == {"scale", "window_size", "enable_gqa"}
    assert attention.varlen_keywords(varlen_old) == {"is_causal"}
    assert attention.varlen_keywords(functools.partial(varlen_old)) == {"is_causal"}
    assert attention.varlen_keywords(len) == frozenset()  # a builtin without a signature: nothing assumed


@pytest.mark.parametrize(("keywords", "gqa", "window", "default_scale", "fused", "kwargs", "expand", "prescale"), [
    ({"scale", "window_size", "enable_gqa"}, True, True, False, True, ("window_size", "enable_gqa", "scale"), False, False),
    ({"scale", "window_size", "enable_gqa"}, False, False, True, True, ("window_size", "scale"), False, False),
    ({"is_causal"}, True, False, False, True, ("is_causal",), True, True),
    ({"is_causal"}, True, True, True, False, (), False, False),  # a window needs window_size
    (set(), False, False, True, False, (), False, False),  # not even causal
    ({"window_size"}, True, False, True, True, ("window_size",), True, False),
])
def test_varlen_plan_per_signature(keywords, gqa, window, default_scale, fused, kwargs, expand, prescale):
    plan = attention.varlen_plan(frozenset(keywords), gqa=gqa, window=window, default_scale=default_scale)
    assert (plan.fused, plan.kwargs, plan.expand_kv, plan.prescale_query) == (fused, kwargs, expand, prescale), plan
    assert plan.why


def test_an_older_varlen_attn_runs_fused_with_substitutes_and_says_so(monkeypatch, caplog):
    import torch.nn.attention.varlen as varlen

    core = _core(4, 2, 8)
    core.softmax_scale = 0.3  # not 1/sqrt(8): must be folded into the query
    lengths = (5, 1, 7)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(lengths), 4, 8, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7)
    expected = core(q, k, v, attention_mask=None, packed_seq_params=params)  # the per-sequence twin on CPU
    calls = []

    @functools.wraps(varlen_old)
    def recording(*args, **kwargs):
        calls.append(kwargs)
        return varlen_old(*args, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", recording)
    monkeypatch.setattr(attention, "packed_attention_kernel", lambda query, dropout: (attention.FLASH_VARLEN, "forced"))
    monkeypatch.setattr(attention, "_ANNOUNCED_KERNELS", set())
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        out = core(q, k, v, attention_mask=None, packed_seq_params=params)
        core(q, k, v, attention_mask=None, packed_seq_params=params)
    assert calls == [{"is_causal": True}] * 2
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    said = [r.getMessage() for r in caplog.records if "packed attention" in r.getMessage()]
    assert len(said) == 1, said  # once per process
    assert "flash_varlen" in said[0] and "is_causal" in said[0] and "K/V repeated" in said[0] and "scale" in said[0]


def test_a_window_without_window_size_runs_the_per_sequence_twin_and_says_so(monkeypatch, caplog):
    import torch.nn.attention.varlen as varlen

    core = _core(4, 2, 8, window=2)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(9, 4, 8, generator=gen)
    k, v = (torch.randn(9, 2, 8, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    expected = core(q, k, v, attention_mask=None, packed_seq_params=params)
    monkeypatch.setattr(varlen, "varlen_attn", varlen_old)
    monkeypatch.setattr(attention, "packed_attention_kernel", lambda query, dropout: (attention.FLASH_VARLEN, "forced"))
    monkeypatch.setattr(attention, "_ANNOUNCED_KERNELS", set())
    with caplog.at_level(logging.INFO, logger=attention.__name__):
        out = core(q, k, v, attention_mask=None, packed_seq_params=params)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "sdpa_per_sequence" in said and "window_size" in said, said


GIB = 2**30


@pytest.mark.parametrize("preset", ["grpo_7b", "grpo_32b", "grpo_70b", "grpo_qwen3_30b_a3b"])
def test_gpu_presets_train_on_varlen_flash_and_the_planner_counts_the_padded_kernel(preset):
    """The GPU presets pack sequences (THD, varlen flash: nothing beyond flash's activations); with padded
    micro-batches the planner shows what mem-efficient keeps (mask, K/V copies), and never a math kernel."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import build_plan

    plan = build_plan(load_config(overrides=[f"+experiment={preset}"]))
    assert not [r.label for r in plan.rows if "attention kernel" in r.label], "packed: varlen flash, no extra row"
    padded = build_plan(load_config(overrides=[f"+experiment={preset}",
                                               "actor_rollout_ref.actor.megatron.packed_sequences=false"]))
    (row,) = [r for r in padded.rows if r.label.startswith("actor attention kernel")]
    assert "sdpa_mem_efficient" in row.label and "math" not in row.label, row.label
    if preset == "grpo_70b":
        # 20 layers x 4 micro-batches in flight x (3072 x 3072 x 2 B mask + 7 x 128 x 2 x 2 B x 3072 K/V copies)
        expected = 20 * 4 * (3072 * 3072 * 2 + 7 * 128 * 2 * 2 * 3072)
        assert row.per_phase["actor update"] == pytest.approx(expected)  # 2.23 GiB
