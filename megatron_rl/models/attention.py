"""Attention core on torch SDPA (runs on CPU and GPU) and the [B, T] padding mask -> 4-D mask helper.

Megatron's local ``DotProductAttention`` builds its default causal mask on "cuda" and has no sliding
window; RL batches are padded on both sides (prompts left, responses right), so every forward needs
an explicit causal + padding mask anyway. Mask convention is Megatron's: a bool tensor broadcastable
to [B, 1, Tq, Tk] where True means "do not attend".
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

log = logging.getLogger(__name__)

FLASH_VARLEN = "flash_varlen"
SDPA_PER_SEQUENCE = "sdpa_per_sequence"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_ANNOUNCED_KERNELS: set[str] = set()
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

    Grouped-query attention is handled by SDPA's ``enable_gqa`` (key/value heads are not copied).
    With ``config.window_size = (left, 0)`` keys more than ``left`` positions back are masked, which
    is Mistral's sliding window.
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
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism (CP > 1)")
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
        seq_q, batch, heads, dim = query.shape
        seq_k = key.shape[0]
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))

        blocked = attention_mask
        if self.window_left is not None:
            window = self._window_mask(seq_q, seq_k, query.device)
            blocked = window if blocked is None else blocked | window
        if blocked is None:
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                scale=self.softmax_scale,
                dropout_p=self.dropout_p if self.training else 0.0,
                enable_gqa=True,
            )
        else:
            if blocked.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool (True = blocked), got {blocked.dtype}")
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=~blocked,
                scale=self.softmax_scale,
                dropout_p=self.dropout_p if self.training else 0.0,
                enable_gqa=True,
            )
        # [b, h, s, d] -> [s, b, h*d]
        return out.permute(2, 0, 1, 3).reshape(seq_q, batch, heads * dim)

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
        kernel, why = packed_attention_kernel(query, dropout_p)
        if kernel not in _ANNOUNCED_KERNELS:
            # said once per process and kernel, so a run's log shows which attention its packs got
            log.info("packed attention: %s (%s)", kernel, why)
            _ANNOUNCED_KERNELS.add(kernel)
        heads, dim = query.shape[1], query.shape[2]
        if kernel == FLASH_VARLEN:
            out = self._flash_varlen(query, key, value, cu_q, packed_seq_params.max_seqlen_q)
        else:
            out = self._sdpa_per_sequence(query, key, value, cu_q.tolist(), dropout_p)
        return out.reshape(out.shape[0], heads * dim)

    def _flash_varlen(self, query, key, value, cu_seqlens: torch.Tensor, max_seqlen: int | None) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        # (left, 0): causal, keys at most `left` back (Mistral's window); (-1, 0): plain causal
        window = (self.window_left if self.window_left is not None else -1, 0)
        return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                           scale=self.softmax_scale, window_size=window, enable_gqa=True)

    def _sdpa_per_sequence(self, query, key, value, bounds: list[int], dropout_p: float) -> torch.Tensor:
        """The varlen twin: one SDPA call per sequence without a mask, token for token the padded
        path's numbers (the CPU kernel, and the fallback where flash cannot run)."""
        out = query.new_empty(query.shape)
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            # [s, h, d] -> [1, h, s, d]
            q, k, v = (t[start:end].permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
            seq = end - start
            kwargs: dict = {"is_causal": True}
            if self.window_left is not None:
                kwargs = {"attn_mask": ~self._window_mask(seq, seq, query.device)}
            piece = F.scaled_dot_product_attention(
                q, k, v, scale=self.softmax_scale, dropout_p=dropout_p, enable_gqa=True, **kwargs,
            )
            out[start:end] = piece.squeeze(0).permute(1, 0, 2)
        return out
