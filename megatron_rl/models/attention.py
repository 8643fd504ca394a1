"""Attention core on torch SDPA (runs on CPU and GPU) and the [B, T] padding mask -> 4-D mask helper.

Megatron's local ``DotProductAttention`` builds its default causal mask on "cuda" and has no sliding
window; RL batches are padded on both sides (prompts left, responses right), so every forward needs
an explicit causal + padding mask anyway. Mask convention is Megatron's: a bool tensor broadcastable
to [B, 1, Tq, Tk] where True means "do not attend".
"""

from __future__ import annotations

import inspect
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.distributed.context_parallel import chunk_positions, gather_over_cp

log = logging.getLogger(__name__)

FLASH_VARLEN = "flash_varlen"
SDPA_PER_SEQUENCE = "sdpa_per_sequence"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_ANNOUNCED_KERNELS: set[str] = set()
# The padded path's SDPA call on CUDA (padded_attention_plan): which backend torch can pick for it.
SDPA_FLASH = "sdpa_flash"  # no mask (is_causal): flash takes GQA as is
SDPA_EFFICIENT = "sdpa_mem_efficient"  # a mask and as many K/V heads as query heads
SDPA_EFFICIENT_EXPANDED_KV = "sdpa_mem_efficient_expanded_kv"  # a mask + GQA: K/V repeated to the query heads
SDPA_MATH = "sdpa_math"  # no fused kernel takes the call: fp32 s x s scores stored for backward
SDPA_CPU = "sdpa_cpu"
CP_ALL_GATHER = "cp_all_gather"  # context parallel: K/V all-gathered over CP, per-chunk causal masks
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Column segments of a shared-prompt sequence (workers/shared_prompts.py): the prompt, a pad, or else the
# response's row in its micro-batch.
PROMPT_SEGMENT = -1
PAD_SEGMENT = -2


def packed_attention_kernel(query: torch.Tensor, dropout_p: float) -> tuple[str, str]:
    """The kernel packed (THD) attention runs on for ``query``, and why.

    torch's ``varlen_attn`` is flash attention's ``cu_seqlens`` kernel: one fused call over every
    sequence of the pack, no mask, no per-sequence launches. It exists on CUDA only, for fp16/bf16,
    and without dropout; anywhere else the per-sequence SDPA twin runs (same numbers, more launches).
    """
    if not query.is_cuda:
        return SDPA_PER_SEQUENCE, f"query on {query.device.type}, the fused varlen kernel is CUDA-only"
    if query.dtype not in _FLASH_DTYPES:
        return SDPA_PER_SEQUENCE, f"query dtype {query.dtype}, the fused varlen kernel takes fp16/bf16"
    if dropout_p > 0.0:
        return SDPA_PER_SEQUENCE, f"attention_dropout={dropout_p}, the fused varlen kernel has no dropout"
    return FLASH_VARLEN, "CUDA, half precision, no dropout"


@dataclass(frozen=True)
class PaddedAttentionPlan:
    kernel: str
    expand_kv: bool  # repeat K/V heads to the query heads before the call (no enable_gqa)
    why: str


def padded_attention_plan(
    *, on_cuda: bool, dtype: torch.dtype, q_heads: int, kv_heads: int, head_dim: int, masked: bool
) -> PaddedAttentionPlan:
    """How the padded path calls SDPA so that torch never falls back to its math kernel on CUDA.

    torch's backend rules (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, ``can_use_*``), as
    strictly as every torch we may meet applies them: flash takes no ``attn_mask`` at all (fp16/bf16,
    head_dim <= 256, GQA allowed); mem-efficient takes a mask but, before torch made it GQA-aware, only as
    many K/V heads as query heads, and a head_dim divisible by 8 (half) or 4 (fp32) on sm80+; cuDNN's
    attention is preferred only with some cuDNN versions and GPUs, so it is not counted on. An RL batch
    always needs a mask here (padding, a sliding window, shared prompts), so a GQA model's call
    ``attn_mask + enable_gqa=True`` ran on the math kernel, storing fp32 [heads, s, s] probabilities per
    layer (issue 32). With a mask the K/V heads are now repeated to the query heads first (their
    [b, h, s, d] copies and the mask converted to the query's dtype are what mem-efficient keeps for
    backward: plan.memory counts them); packed sequences (THD) avoid all of it with varlen flash.
    """
    if not on_cuda:
        return PaddedAttentionPlan(SDPA_CPU, False, "not on CUDA: torch's CPU kernels take mask + GQA")
    gqa = q_heads != kv_heads
    if not masked:
        if dtype in _HALF_DTYPES and head_dim <= 256:
            return PaddedAttentionPlan(SDPA_FLASH, False, "no mask, half precision: flash (GQA native)")
        masked_why = f"{dtype}: no flash"
    else:
        masked_why = "a mask: no flash"
    alignment = 8 if dtype in _HALF_DTYPES else 4
    if head_dim % alignment:
        return PaddedAttentionPlan(SDPA_MATH, False, f"{masked_why}, head_dim {head_dim} not a multiple of "
                                   f"{alignment} for mem-efficient")
    if gqa:
        return PaddedAttentionPlan(SDPA_EFFICIENT_EXPANDED_KV, True,
                                   f"{masked_why}; mem-efficient with K/V repeated from {kv_heads} to {q_heads} heads")
    return PaddedAttentionPlan(SDPA_EFFICIENT, False, f"{masked_why}; mem-efficient")


# varlen_attn's keyword arguments differ between torch releases: detected, not assumed (issue 32, item 17).
VARLEN_KWARGS = ("scale", "window_size", "enable_gqa", "is_causal")


def varlen_keywords(fn) -> frozenset[str]:
    """The keyword arguments of ``fn`` (torch's ``varlen_attn``) among VARLEN_KWARGS."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(name for name in VARLEN_KWARGS if name in params)


@dataclass(frozen=True)
class VarlenPlan:
    fused: bool  # False: the per-sequence SDPA twin runs instead
    kwargs: tuple[str, ...]  # the keyword arguments passed
    expand_kv: bool  # K/V repeated to the query heads (no enable_gqa)
    prescale_query: bool  # softmax scale folded into the query (no scale)
    why: str


def varlen_plan(keywords: frozenset[str], *, gqa: bool, window: bool, default_scale: bool) -> VarlenPlan:
    """How to call a ``varlen_attn`` that takes ``keywords``: its own keyword where it has one, an exact
    substitute where it has not (repeat K/V for enable_gqa, fold a non-default scale into the query, is_causal
    for a plain causal window), else the per-sequence SDPA twin."""
    passed: list[str] = []
    notes: list[str] = []
    if "window_size" in keywords:
        passed.append("window_size")
    elif window:
        return VarlenPlan(False, (), False, False, "varlen_attn has no window_size: a sliding window needs it")
    elif "is_causal" in keywords:
        passed.append("is_causal")
        notes.append("causal through is_causal (no window_size)")
    else:
        return VarlenPlan(False, (), False, False, "varlen_attn has neither window_size nor is_causal")
    expand = False
    if gqa:
        if "enable_gqa" in keywords:
            passed.append("enable_gqa")
        else:
            expand = True
            notes.append("K/V repeated to the query heads (no enable_gqa)")
    prescale = False
    if "scale" in keywords:
        passed.append("scale")
    elif not default_scale:
        prescale = True
        notes.append("softmax scale folded into the query (no scale)")
    return VarlenPlan(True, tuple(passed), expand, prescale,
                      "fused varlen_attn(" + ", ".join(passed) + ")" + ("; " + "; ".join(notes) if notes else ""))


def _announce(kind: str, kernel: str, why: str) -> None:
    """Said once per process and kernel, so a run's log shows which attention it got."""
    key = f"{kind}:{kernel}:{why}"
    if key not in _ANNOUNCED_KERNELS:
        log.info("%s attention: %s (%s)", kind, kernel, why)
        _ANNOUNCED_KERNELS.add(key)


def _repeat_kv(t: torch.Tensor, heads: int, head_dim_axis: int) -> torch.Tensor:
    """[.., kv_heads, ..] -> [.., heads, ..] along ``head_dim_axis`` (each K/V head serves its group)."""
    groups = heads // t.shape[head_dim_axis]
    return t if groups == 1 else t.repeat_interleave(groups, dim=head_dim_axis)


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] mask (1 = real token, 0 = pad) -> [B, 1, T, T] bool mask, True = blocked.

    A query attends to earlier-or-same positions that are real tokens. A pad query is allowed to
    see itself so its softmax row is never empty (no NaN); its output is ignored downstream.
    """
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [batch, seq], got shape {tuple(attention_mask.shape)}")
    seq = attention_mask.shape[1]
    valid_key = attention_mask.bool()[:, None, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    diagonal = torch.eye(seq, dtype=torch.bool, device=attention_mask.device)
    allowed = causal & (valid_key | diagonal)
    return ~allowed


def shared_prompt_mask(segment: torch.Tensor) -> torch.Tensor:
    """[S, W] column segments of shared-prompt sequences -> [S, 1, W, W] bool mask, True = blocked.

    The tree mask of ``[prompt | response 1 | ... | response n]``: a query sees earlier-or-same
    columns of the prompt and of its own response. A pad sees only itself (never an empty softmax
    row; its output is never read).
    """
    if segment.dim() != 2:
        raise ValueError(f"segment must be [sequences, width], got shape {tuple(segment.shape)}")
    width = segment.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment.device).tril()
    query, key = segment[:, :, None], segment[:, None, :]
    allowed = causal & (query != PAD_SEGMENT) & ((key == PROMPT_SEGMENT) | (key == query))
    allowed |= torch.eye(width, dtype=torch.bool, device=segment.device)
    return ~allowed[:, None]


class SDPAttention(MegatronModule):
    """Drop-in for Megatron's core attention: [s, b, heads, dim] q/k/v in, [s, b, heads*dim] out.

    Grouped-query attention is handled by SDPA's ``enable_gqa`` (key/value heads are not copied), except
    for a masked call on CUDA, where K/V are repeated so that mem-efficient rather than the math kernel
    runs (``padded_attention_plan``). With ``config.window_size = (left, 0)`` keys more than ``left``
    positions back are masked, which is Mistral's sliding window.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,  # MLA: q/k heads are wider than v heads; SDPA takes both as they come
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        # CP > 1 runs on packed sequences only (plan/validate.py refuses padded batches before launch)
        self.cp_size = config.context_parallel_size
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window_left = config.window_size[0] if config.window_size is not None else None

    def _window_mask(self, seq_q: int, seq_k: int, device: torch.device) -> torch.Tensor:
        """True for keys in the future or further back than the window (queries aligned at the end)."""
        q_idx = torch.arange(seq_k - seq_q, seq_k, device=device)[:, None]
        k_idx = torch.arange(seq_k, device=device)[None, :]
        distance = q_idx - k_idx
        return (distance > self.window_left) | (distance < 0)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention bias")
        if packed_seq_params is not None:
            return self._forward_thd(query, key, value, packed_seq_params)
        if self.cp_size > 1:
            raise ValueError(f"context_parallel_size={self.cp_size} needs packed sequences (THD): the padded "
                             "[s, b] layout is not split over CP ranks")
        seq_q, batch, heads, dim = query.shape
        seq_k = key.shape[0]
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))

        blocked = attention_mask
        if self.window_left is not None:
            window = self._window_mask(seq_q, seq_k, query.device)
            blocked = window if blocked is None else blocked | window
        if blocked is not None and blocked.dtype != torch.bool:
            raise ValueError(f"attention_mask must be bool (True = blocked), got {blocked.dtype}")
        plan = padded_attention_plan(on_cuda=query.is_cuda, dtype=query.dtype, q_heads=heads,
                                     kv_heads=key.shape[2], head_dim=dim, masked=blocked is not None)
        _announce("padded", plan.kernel, plan.why)
        if plan.expand_kv:
            k, v = _repeat_kv(k, heads, 1), _repeat_kv(v, heads, 1)
        mask_kwargs: dict = {"is_causal": True} if blocked is None else {"attn_mask": ~blocked}
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            scale=self.softmax_scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            enable_gqa=not plan.expand_kv,
            **mask_kwargs,
        )
        # [b, h, s, d_v] -> [s, b, h*d_v] (d_v: value's head dim, MLA's differs from q/k's)
        return out.permute(2, 0, 1, 3).reshape(seq_q, batch, -1)

    def _forward_thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed_seq_params):
        """Packed sequences (THD, ``PackedSeqParams`` with ``cu_seqlens``): [t, heads, dim] q/k/v of
        sequences laid end to end, [t, heads*dim] out. Each sequence attends causally to itself only
        (block-diagonal causal attention): cost sum(s_i^2), not t^2, and no [t, t] mask exists."""
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"SDPAttention packs only the thd format, got {packed_seq_params.qkv_format!r}")
        cu_q, cu_k = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if not torch.equal(cu_q, cu_k):
            raise ValueError("SDPAttention: packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        dropout_p = self.dropout_p if self.training else 0.0
        if self.cp_size > 1:
            _announce("packed", CP_ALL_GATHER, f"context parallel {self.cp_size}: K/V all-gathered over the CP group")
            out = self._context_parallel(query, key, value, cu_q, packed_seq_params.cp_group, dropout_p)
            return out.reshape(out.shape[0], -1)
        kernel, why = packed_attention_kernel(query, dropout_p)
        varlen = None
        if kernel == FLASH_VARLEN:
            varlen = self._varlen_plan(query, key)
            if not varlen.fused:
                kernel, why = SDPA_PER_SEQUENCE, varlen.why
            else:
                why = f"{why}; {varlen.why}"
        _announce("packed", kernel, why)
        if kernel == FLASH_VARLEN:
            out = self._flash_varlen(query, key, value, cu_q, packed_seq_params.max_seqlen_q, varlen)
        else:
            out = self._sdpa_per_sequence(query, key, value, cu_q.tolist(), dropout_p)
        return out.reshape(out.shape[0], -1)

    def _varlen_plan(self, query: torch.Tensor, key: torch.Tensor) -> VarlenPlan:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as error:
            return VarlenPlan(False, (), False, False, f"torch has no varlen_attn ({error})")
        return varlen_plan(varlen_keywords(varlen_attn), gqa=query.shape[1] != key.shape[1],
                           window=self.window_left is not None,
                           default_scale=math.isclose(self.softmax_scale, query.shape[2] ** -0.5, rel_tol=1e-12))

    def _flash_varlen(self, query, key, value, cu_seqlens: torch.Tensor, max_seqlen: int | None,
                      plan: VarlenPlan) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        kwargs: dict = {}
        if "window_size" in plan.kwargs:
            # (left, 0): causal, keys at most `left` back (Mistral's window); (-1, 0): plain causal
            kwargs["window_size"] = (self.window_left if self.window_left is not None else -1, 0)
        if "is_causal" in plan.kwargs:
            kwargs["is_causal"] = True
        if "enable_gqa" in plan.kwargs:
            kwargs["enable_gqa"] = True
        if "scale" in plan.kwargs:
            kwargs["scale"] = self.softmax_scale
        if plan.expand_kv:
            key, value = _repeat_kv(key, query.shape[1], 1), _repeat_kv(value, query.shape[1], 1)
        if plan.prescale_query:  # varlen_attn's default scale is 1/sqrt(head_dim)
            query = query * (self.softmax_scale * math.sqrt(query.shape[2]))
        return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)

    def _context_parallel(self, query, key, value, cu_seqlens: torch.Tensor, cp_group, dropout_p: float):
        """Exact causal attention of this CP rank's queries over the whole sequences: K and V of every CP
        rank are all-gathered (Megatron's cp_comm_type=all_gather; its gradient goes back to the rank that
        computed them), and each of this rank's two chunks of a sequence attends to the keys at positions
        up to its own (and within the sliding window). ``cu_seqlens`` are the global pack's."""
        from megatron.core import parallel_state

        group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
        cp_rank = dist.get_rank(group)
        keys, values = gather_over_cp(key, group), gather_over_cp(value, group)  # [CP, t, kv_heads, d]
        bounds = cu_seqlens.tolist()
        out = query.new_empty(*query.shape[:-1], value.shape[-1])  # value's head dim (MLA: not q's)
        local = 0
        for start, end in zip(bounds[:-1], bounds[1:]):
            length = end - start
            width = length // self.cp_size  # this sequence's tokens on every CP rank
            q_pos = chunk_positions(length, self.cp_size, cp_rank, query.device)
            k_pos = torch.cat([chunk_positions(length, self.cp_size, r, query.device) for r in range(self.cp_size)])
            # [1, heads, tokens, d]
            q = query[local:local + width].permute(1, 0, 2).unsqueeze(0)
            k = keys[:, local:local + width].flatten(0, 1).permute(1, 0, 2).unsqueeze(0)
            v = values[:, local:local + width].flatten(0, 1).permute(1, 0, 2).unsqueeze(0)
            distance = q_pos[:, None] - k_pos[None, :]
            allowed = distance >= 0
            if self.window_left is not None:
                allowed &= distance <= self.window_left
            plan = padded_attention_plan(on_cuda=q.is_cuda, dtype=q.dtype, q_heads=q.shape[1], kv_heads=k.shape[1],
                                         head_dim=q.shape[-1], masked=True)
            if plan.expand_kv:
                k, v = _repeat_kv(k, q.shape[1], 1), _repeat_kv(v, q.shape[1], 1)
            piece = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.softmax_scale,
                                                   dropout_p=dropout_p, enable_gqa=not plan.expand_kv)
            out[local:local + width] = piece.squeeze(0).permute(1, 0, 2)
            local += width
        return out

    def _sdpa_per_sequence(self, query, key, value, bounds: list[int], dropout_p: float) -> torch.Tensor:
        """The varlen twin: one SDPA call per sequence without a mask, token for token the padded
        path's numbers (the CPU kernel, and the fallback where flash cannot run)."""
        out = query.new_empty(*query.shape[:-1], value.shape[-1])  # value's head dim (MLA: not q's)
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            # [s, h, d] -> [1, h, s, d]
            q, k, v = (t[start:end].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
            seq = end - start
            kwargs: dict = {"is_causal": True}
            if self.window_left is not None:
                kwargs = {"attn_mask": ~self._window_mask(seq, seq, query.device)}
            plan = padded_attention_plan(on_cuda=q.is_cuda, dtype=q.dtype, q_heads=q.shape[1], kv_heads=k.shape[1],
                                         head_dim=q.shape[-1], masked="attn_mask" in kwargs)
            if plan.expand_kv:
                k, v = _repeat_kv(k, q.shape[1], 1), _repeat_kv(v, q.shape[1], 1)
            piece = F.scaled_dot_product_attention(
                q, k, v, scale=self.softmax_scale, dropout_p=dropout_p, enable_gqa=not plan.expand_kv, **kwargs,
            )
            out[start:end] = piece.squeeze(0).permute(1, 0, 2)
        return out
