"""Critic loss (clipped value regression) and the actor's regularisers: entropy bonus and KL loss."""

from __future__ import annotations

import torch

from megatron_rl import ops
from megatron_rl.algos._checks import check_token_tensors
from megatron_rl.algos.kl import kl_penalty
from megatron_rl.algos.loss_agg import LOCAL_BATCH, GlobalBatchInfo, agg_loss


def check_cliprange_value(cliprange_value: float) -> None:
    """``critic.cliprange_value``: the clip range of the value update, >= 0 (0 keeps the old values). The rule of
    ``compute_value_loss`` and of validation (plan/validate.py)."""
    if not cliprange_value >= 0:
        raise ValueError(f"critic.cliprange_value must be >= 0, got {cliprange_value}")


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo = LOCAL_BATCH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * agg(max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2)), and vf_clipfrac (the share of
    valid tokens where the clipped term is larger). ``values`` are the rollout-time (old) values."""
    check_token_tensors(vpreds=vpreds, returns=returns, values=values, response_mask=response_mask)
    check_cliprange_value(cliprange_value)
    mask = response_mask.float()
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpred_clipped - returns) ** 2
    per_token = torch.maximum(unclipped, clipped)
    loss = 0.5 * agg_loss(per_token, mask, loss_agg_mode, **global_batch.agg_kwargs())
    vf_clipfrac = ops.masked_mean(torch.gt(clipped, unclipped).float(), mask).detach()
    return loss, vf_clipfrac


def compute_entropy_loss(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo = LOCAL_BATCH,
) -> torch.Tensor:
    """Aggregated per-token entropy; the actor's loss is pg_loss - entropy_coeff * this (the bonus).

    verl's version takes logits; this one takes the per-token entropy that
    ``ops.log_probs_from_logits(..., with_entropy=True)`` computes from vocab-sharded logits.
    """
    return agg_loss(entropy, response_mask, loss_agg_mode, **global_batch.agg_kwargs())


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_loss_type: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_batch: GlobalBatchInfo = LOCAL_BATCH,
) -> torch.Tensor:
    """KL to the reference as a loss term (``actor.use_kl_loss``); the actor adds kl_loss_coef * this."""
    check_token_tensors(log_prob=log_prob, ref_log_prob=ref_log_prob, response_mask=response_mask)
    per_token = kl_penalty(log_prob, ref_log_prob, kl_loss_type)
    return agg_loss(per_token, response_mask, loss_agg_mode, **global_batch.agg_kwargs())
