"""masked_whiten through the fused kernels; masked_mean is already a single torch reduction."""

from __future__ import annotations

import torch

from megatron_rl.ops import _checks, reference
from megatron_rl.ops._extension import kernels_for

masked_mean = reference.masked_mean


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) * rsqrt(var + 1e-8) over the masked elements (verl: unbiased variance, fp32 result).

    Masked-out slots are transformed too, not zeroed. Raises ValueError when the mask selects fewer than
    two elements (verl raises there as well).
    """
    ops = kernels_for(x)
    if ops is None:
        return reference.masked_whiten(x, mask, shift_mean)
    _checks.check_masked_args(x, mask)
    return ops.masked_whiten(x, mask, bool(shift_mean))
