"""Context parallelism (CP): which tokens of a packed micro-batch each CP rank holds, and the two
differentiable collectives that join the ranks' work again.

Megatron and Transformer Engine split every sequence of a THD pack into ``2 x CP`` equal chunks and give
CP rank ``r`` chunks ``r`` and ``2 x CP - 1 - r`` (load balance: under causal attention an early chunk is
cheap and a late one dear, so each rank gets one of each). A sequence's length must therefore be a
multiple of ``2 x CP`` (Megatron pads each one at its end; causal attention keeps the pads out of the
real tokens' outputs). Each rank's pack is its chunks of sequence 0, then of sequence 1, ...; its
``cu_seqlens`` are the global ones divided by CP, which is how Megatron's RoPE reads them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_positions(length: int, cp_size: int, cp_rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Positions (0..length-1) of one sequence that ``cp_rank`` holds, in its local order."""
    if length % (2 * cp_size):
        raise ValueError(f"a sequence of {length} tokens cannot be split into 2 x CP = {2 * cp_size} equal chunks")
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, last])


def local_pack_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[T / CP] positions in the global pack (sequences bounded by ``cu_seqlens``) of ``cp_rank``'s tokens."""
    bounds = cu_seqlens.tolist()
    pieces = [start + chunk_positions(end - start, cp_size, cp_rank, cu_seqlens.device)
              for start, end in zip(bounds[:-1], bounds[1:])]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=cu_seqlens.device)


class _GatherOverCP(torch.autograd.Function):
    """[t, ...] on each rank -> [CP, t, ...] everywhere; backward: each rank gets the sum over ranks of the
    gradient of its own slice (a reduce-scatter, done as all-reduce + slice: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _SumOverCP(torch.autograd.Function):
    """Forward: the sum over CP ranks of tensors that are each zero outside the rank's own tokens.
    Backward: identity. Every CP rank then computes the same loss from the whole tensor and sends its
    gradient into its own tokens only; summing the parameter gradients over DP x CP (Megatron's DDP does)
    counts each token exactly once."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def gather_over_cp(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[t, ...] -> [CP, t, ...]: every CP rank's tensor (differentiable)."""
    return _GatherOverCP.apply(tensor, group)


def sum_over_cp(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sum over CP ranks of per-rank tensors with disjoint support (differentiable, see _SumOverCP)."""
    return _SumOverCP.apply(tensor, group)
