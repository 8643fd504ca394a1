"""Policy-gradient form: the gradient flows through log pi, times a detached per-token factor -- none (GPG),
a quadratic log-ratio penalty (DRO), the clipped IS weight (CISPO), a trust-region mask on the capped ratio
(DPPO, binary TV or binary KL). verl 0.9.1's formulas, clamps and metric names.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl import ops
from megatron_rl.algos.config_view import ActorConfigLike
from megatron_rl.algos.loss_agg import GlobalBatchInfo, agg_loss
from megatron_rl.algos.policy_loss_common import apply_token_weights, check_loss_inputs, clamped_ratio
from megatron_rl.algos.policy_loss_config import PolicyLossConfig


def _dppo(
    kind: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: PolicyLossConfig | ActorConfigLike | None,
    rollout_is_weights: Optional[torch.Tensor],
    rollout_log_probs: Optional[torch.Tensor],
    global_batch: Optional[GlobalBatchInfo],
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO with the trust region ``kind`` ("tv": binary total variation, "kl": binary KL)."""
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio, ratio = clamped_ratio(old_log_prob, log_prob)
    cap = config.clip_ratio_c
    truncated = torch.clamp(ratio, max=cap).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if kind == "tv":
        ok_pos = (prob - old_prob) <= config.high
        ok_neg = (prob - old_prob) >= -config.low
    else:  # binary KL between Bernoulli(old_prob) and Bernoulli(prob)
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        ok_pos = (binary_kl <= config.high) | (prob <= old_prob)
        ok_neg = (binary_kl <= config.low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, ok_pos, ok_neg).detach().float()
    pg_losses = -advantages * truncated * log_prob * valid
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean(1.0 - valid, mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": ops.masked_mean((ratio > cap).float() * valid, mask).item(),
    }
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


def compute_policy_loss_dppo_tv(
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
    """DPPO, binary-TV trust region (https://arxiv.org/abs/2602.04879). A token leaves the loss when its
    probability moved past the region in the advantage's direction: A > 0 and p - p_old > clip_ratio_high,
    or A <= 0 and p - p_old < -clip_ratio_low (clip_ratio_* are probability differences here).
    l = -A * sg[min(ratio, clip_ratio_c)] * logp * valid. pg_clipfrac: share outside the region;
    pg_clipfrac_lower: share inside it whose ratio exceeds clip_ratio_c."""
    return _dppo("tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights, rollout_log_probs, global_batch)


def compute_policy_loss_dppo_kl(
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
    """DPPO, binary-KL trust region: as ``dppo_tv`` with the divergence
    KL(Bern(p_old) || Bern(p)) = p_old*log(p_old/p) + (1-p_old)*log((1-p_old+1e-8)/(1-p+1e-8)),
    bounded by clip_ratio_high when A > 0 and p rose, by clip_ratio_low when A <= 0 and p fell."""
    return _dppo("kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights, rollout_log_probs, global_batch)


def compute_policy_loss_gpg(
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
    """GPG (https://arxiv.org/abs/2504.02546): plain policy gradient, l = -A * logp (no ratio, no clip;
    ``old_log_prob`` only shapes the checks). No metrics (verl returns none either)."""
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    metrics: dict[str, float] = {}
    pg_losses = apply_token_weights(-log_prob * advantages, old_log_prob, rollout_log_probs, rollout_is_weights, mask,
                                    config, metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


def compute_policy_loss_dro(
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
    """Direct Reward Optimization (https://arxiv.org/abs/2405.19107) as verl 0.9.1 has it: policy gradient
    with a quadratic log-ratio penalty, l = -(A * logp - dro_beta/2 * (logp - old)^2); ``dro_beta``
    (``actor.policy_loss.dro_beta``) must be set > 0."""
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    beta = config.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be a positive value when using DRO, got {beta}")
    mask = response_mask.float()
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    metrics = {"actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item()}
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


def compute_policy_loss_cispo(
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
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the IS weight, not the update, so every
    token keeps a gradient. l = -sg[clip(ratio, 1-clip_ratio_low, 1+clip_ratio_high)] * A * logp,
    ratio = exp(clamp(logp - old, -20, 20)). pg_clipfrac: share of tokens whose weight was clipped;
    pg_clipfrac_lower = 0."""
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio, ratio = clamped_ratio(old_log_prob, log_prob)
    weight = torch.clamp(ratio, 1 - config.low, 1 + config.high)
    pg_losses = -weight.detach() * advantages * log_prob
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean((ratio != weight).float(), mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics
