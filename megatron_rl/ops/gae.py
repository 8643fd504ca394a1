"""masked_gae: verl's masked GAE (not whitened) through the fused kernels."""

from __future__ import annotations

import torch

from megatron_rl.ops import _checks, reference
from megatron_rl.ops._extension import kernels_for


def masked_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns = advantages + values), fp32 [B, T], advantages not whitened.

    Reverse recurrence over t: delta = r_t + gamma * next_value - v_t; masked tokens (mask 0) carry both
    next_value and the running advantage through unchanged (multi-turn observation tokens).
    """
    ops = kernels_for(token_level_rewards)
    if ops is None:
        return reference.masked_gae(token_level_rewards, values, response_mask, gamma, lam)
    _checks.check_gae_args(token_level_rewards, values, response_mask, gamma, lam)
    advantages, returns = ops.masked_gae(token_level_rewards, values, response_mask, float(gamma), float(lam))
    return advantages, returns
