"""group_normalize: GRPO / Dr.GRPO / RLOO advantages from the scores of each prompt's group."""

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
