"""Sequence-level importance ratios: GSPO (one ratio per sequence, clipped PPO-style) and GMPO
("geo_mean": the geometric mean of the clipped token ratios). verl 0.9.1's formulas and metric names.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl import ops
from megatron_rl.algos.config_view import ActorConfigLike
from megatron_rl.algos.loss_agg import GlobalBatchInfo, agg_loss
from megatron_rl.algos.policy_loss_common import apply_token_weights, check_loss_inputs
from megatron_rl.algos.policy_loss_config import PolicyLossConfig


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | ActorConfigLike | None = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    rollout_log_probs: Optional[torch.Tensor] = None,
    global_batch: Optional[GlobalBatchInfo] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (https://arxiv.org/abs/2507.18071): one importance ratio per sequence.

    s_i = exp(mean over valid t of (logp - old)); the token-level ratio is
    sg[s_i] * pi(y_t) / sg[pi(y_t)] (value s_i, gradient through each token's log-prob), its log
    clamped at 10; l = max(-A*s, -A*clip(s, 1-low, 1+high)). No dual clip, so pg_clipfrac_lower = 0.
    """
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    pg_losses = torch.maximum(unclipped, clipped)
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean(torch.gt(clipped, unclipped).float(), mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    # TIS, and verl's rollout correction (algos/rollout_corr.py), detached
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs())
    return loss, metrics


def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | ActorConfigLike | None = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    *,
    rollout_log_probs: Optional[torch.Tensor] = None,
    global_batch: Optional[GlobalBatchInfo] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO (https://arxiv.org/abs/2507.20673): the geometric mean of the token ratios per sequence.
    Each token's log-ratio d is clipped on the advantage's side, d' = sgn(A) * min(sgn(A)*d,
    sgn(A)*clip(d, -clip_ratio_low, clip_ratio_high)) (log space, unclamped otherwise);
    l_i = -mean_t(A) * exp(mean_t(d')) over valid t (denominators + 1e-8); loss = mean over rows,
    ``loss_agg_mode`` ignored (as verl). Token weights (TIS, rollout_is_weights) enter as their
    geometric mean over the sequence. With a global batch (``global_batch_size``) the rows are summed
    and divided by it (times dp_size), so micro-batches add up to the mini-batch mean; verl divides by
    the micro-batch's rows. pg_clipfrac / _lower: share of tokens whose log-ratio the clip moved, A > 0 / A < 0.
    """
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -config.low, config.high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1) + 1e-8
    seq_ratio = torch.exp((clipped_log_ratio * mask).sum(dim=-1) / lengths)
    seq_adv = (advantages * mask).sum(dim=-1) / lengths
    pg_losses = -seq_adv * seq_ratio
    moved = torch.ne(log_ratio, clamped)
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean((moved & (advantages > 0)).float(), mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": ops.masked_mean((moved & (advantages < 0)).float(), mask).item(),
    }
    token_weights = apply_token_weights(torch.ones_like(log_ratio), old_log_prob, rollout_log_probs,
                                        rollout_is_weights, mask, config, metrics)
    if config.tis_imp_ratio_cap is not None or rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp((torch.log(token_weights + 1e-10) * mask).sum(dim=-1) / lengths)
    if global_batch.global_batch_size is None:
        loss = pg_losses.mean()
    else:
        loss = pg_losses.sum() / global_batch.global_batch_size * global_batch.dp_size
    return loss, metrics
