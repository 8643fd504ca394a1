"""group_normalize: GRPO / Dr.GRPO / RLOO advantages from the scores of each prompt's group, and
masked_broadcast: such a per-response advantage spread over the response's tokens."""

from __future__ import annotations

import torch

from megatron_rl.ops import _checks, reference
from megatron_rl.ops._extension import kernels_for


def group_normalize(
    scores: torch.Tensor, group_index: torch.Tensor, *, mode: str, epsilon: float = 1e-6
) -> torch.Tensor:
    """Per-response advantage [B] fp32 from scores [B] and group ids [B] in [0, G), G <= B.

    mode "grpo": (s - mean) / (std_unbiased + epsilon), singletons use mean 0, std 1;
    "grpo_mean": s - mean (Dr.GRPO); "rloo": s * n/(n-1) - mean * n/(n-1). Singletons keep s in the
    last two. Two scatter passes, no loop over groups, no sort.
    """
    ops = kernels_for(scores)
    if ops is None:
        return reference.group_normalize(scores, group_index, mode=mode, epsilon=epsilon)
    num_groups = _checks.check_group_args(scores, group_index, mode, epsilon)
    return ops.group_normalize(scores, group_index, num_groups, mode, float(epsilon))


def _serial_cpu_ops(x: torch.Tensor):
    """torch.ops.megatron_rl for a CPU tensor with the kernels built, else None.

    These passes over [B, T] run on one thread: on shared cores waking a second OpenMP thread cost more
    than the pass (torch's two-thread row sum of 8192 x 1024: 12 ms; one thread: 1.4 ms).
    """
    return kernels_for(x) if x.device.type == "cpu" else None


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """``x.float().sum(dim=-1)`` of a [B, T] tensor (the responses' outcome scores); fp32 CPU input takes one
    serial pass, whose summation order differs from torch's at fp32 rounding."""
    ops = _serial_cpu_ops(x)
    if ops is None or x.dtype != torch.float32 or x.dim() != 2:
        return x.float().sum(dim=-1)
    return ops.row_sums(x)


def masked_broadcast(per_response: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``per_response.unsqueeze(-1) * mask``: [B] times [B, T], with torch's values and dtype.

    On CPU (fp32 values, fp32 or bool mask) one pass writes the result into a block kept from an earlier
    step's large output: a fresh [B, T] tensor spends more time faulting in its pages than writing them.
    """
    ops = _serial_cpu_ops(mask)
    fused = (
        ops is not None
        and per_response.device == mask.device
        and per_response.dtype == torch.float32
        and mask.dtype in (torch.float32, torch.bool)
        and per_response.dim() == 1
        and mask.dim() == 2
        and per_response.shape[0] == mask.shape[0]
    )
    return ops.masked_broadcast(per_response, mask) if fused else per_response.unsqueeze(-1) * mask
