"""The ratio-based PPO family: the clipped objective with clip-higher and dual clip ("vanilla"), AReaL's
decoupled PPO, SAPO's soft gate in place of the clip, and Clip-Cov / KL-Cov (covariance-selected tokens
lose their gradient or get a KL penalty). Each follows verl 0.9.1's formula, clamps and metric names.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl import ops
from megatron_rl.algos.config_view import ActorConfigLike
from megatron_rl.algos.loss_agg import GlobalBatchInfo, agg_loss
from megatron_rl.algos.policy_loss_common import (
    LOG_RATIO_CLAMP,
    apply_token_weights,
    check_loss_inputs,
    clamped_ratio,
)
from megatron_rl.algos.policy_loss_config import PolicyLossConfig


def _dual_clip_losses(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO clip with clip-higher and dual clip on ratio = pi / pi_old, and its metrics."""
    log_ratio, ratio = clamped_ratio(old_log_prob, log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    clipped_max = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * config.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(dual_bound, clipped_max), clipped_max)
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean(torch.gt(clipped, unclipped).float(), mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": ops.masked_mean(
            (torch.gt(clipped_max, dual_bound) & negative).float(), mask
        ).item(),
    }
    return pg_losses, metrics


def compute_policy_loss_vanilla(
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
    """PPO clipped objective with clip-higher and dual clip.

    ratio = exp(clamp(logp - old, -20, 20)); l = max(-A*ratio, -A*clip(ratio, 1-low, 1+high));
    where A < 0: l = min(l, -A*clip_ratio_c). pg_clipfrac: share of tokens where the clip binds;
    pg_clipfrac_lower: share where the dual clip binds; ppo_kl: masked mean of old - logp (clamped).
    """
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    pg_losses, metrics = _dual_clip_losses(old_log_prob, log_prob, advantages, mask, config)
    # TIS, and verl's rollout correction (algos/rollout_corr.py), detached
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs())
    return loss, metrics


def compute_policy_loss_decoupled_ppo(
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
    """Decoupled PPO (AReaL, https://arxiv.org/abs/2505.24298): three policies. ``rollout_log_probs`` are
    the behaviour policy's (the engine that sampled, possibly several versions old), ``old_log_prob`` the
    proximal policy's (the trainer's recomputation with the weights before this update), ``log_prob`` the
    current one's. The clip is on the proximal ratio pi / pi_prox (the vanilla dual clip), and each token's
    loss is multiplied by the behaviour->proximal weight w = exp(old_log_prob - rollout_log_probs), detached;
    with ``behav_imp_weight_cap`` tokens with w above it get weight 0 (they still count in the aggregation's
    denominator, as in AReaL). Metrics: actor/behav_imp_weight_mean|max (over the kept tokens),
    actor/behav_capped_frac, actor/behav_kl (mean of old_log_prob - rollout_log_probs).
    """
    if rollout_log_probs is None:
        raise ValueError("actor_rollout_ref.actor.policy_loss=decoupled_ppo needs rollout_log_probs (the behaviour "
                         "policy's log-probs, returned by the rollout)")
    if rollout_is_weights is not None:
        raise ValueError("actor_rollout_ref.actor.policy_loss=decoupled_ppo weights behaviour->proximal itself: unset "
                         "algorithm.rollout_correction.rollout_is (the weights would count twice)")
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, None, global_batch
    )
    mask = response_mask.float()
    pg_losses, metrics = _dual_clip_losses(old_log_prob, log_prob, advantages, mask, config)
    behav_log = (old_log_prob - rollout_log_probs).detach()
    weights = torch.exp(torch.clamp(behav_log, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    kept = mask.bool()
    if config.behav_imp_weight_cap is not None:
        kept = kept & (weights <= config.behav_imp_weight_cap)
    weights = torch.where(kept, weights, torch.zeros_like(weights))
    metrics |= {
        "actor/behav_imp_weight_mean": ops.masked_mean(weights, kept.float()).item() if kept.any() else 0.0,
        "actor/behav_imp_weight_max": float(weights.max()) if kept.any() else 0.0,
        "actor/behav_capped_frac": ops.masked_mean((~kept).float(), mask).item(),
        "actor/behav_kl": ops.masked_mean(behav_log, mask).item(),
    }
    loss = agg_loss(pg_losses * weights, mask, loss_agg_mode, **global_batch.agg_kwargs())
    return loss, metrics


def compute_policy_loss_sapo(
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
    """SAPO (https://arxiv.org/abs/2511.20347): a soft gate instead of a clip.
    l = -A * sigmoid(tau * (ratio - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg. Always
    aggregated seq-mean-token-mean, whatever ``loss_agg_mode`` says (as verl); pg_clipfrac(_lower) = 0."""
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio, ratio = clamped_ratio(old_log_prob, log_prob)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(config.tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(config.tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    pg_losses = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * advantages
    metrics = {
        "actor/pg_clipfrac": 0.0,
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    return agg_loss(pg_losses, mask, "seq-mean-token-mean", **global_batch.agg_kwargs()), metrics


def compute_policy_loss_clip_cov(
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
    """Clip-Cov (https://arxiv.org/abs/2505.22617): the PPO clip (no dual clip, ratio unclamped), and
    additionally max(1, int(clip_cov_ratio * #valid)) tokens drawn at random (torch's global RNG, as verl)
    from those the clip did not bind on whose centred covariance (A - mean A) * (logp - mean logp) lies in
    (clip_cov_lb, clip_cov_ub) get no loss (and so no gradient). pg_clipfrac: share of tokens dropped."""
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    if not config.clip_cov_ratio > 0:
        raise ValueError(f"policy_loss.clip_cov_ratio must be > 0 for clip_cov, got {config.clip_cov_ratio}")
    mask = response_mask.float()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    valid = mask > 0
    with torch.no_grad():
        cov = (advantages - ops.masked_mean(advantages, mask)) * (log_prob - ops.masked_mean(log_prob, mask))
        candidates = valid & ~(clipped > unclipped) & (cov > config.clip_cov_lb) & (cov < config.clip_cov_ub)
        idx = torch.nonzero(candidates)
        keep = torch.ones_like(advantages)
        if len(idx) > 0:
            n_drop = max(int(config.clip_cov_ratio * mask.sum().item()), 1)
            idx = idx[torch.randperm(len(idx))[: min(n_drop, len(idx))]]
            keep[idx[:, 0], idx[:, 1]] = 0
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean((keep == 0).float(), mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
    }
    pg_losses = torch.maximum(unclipped, clipped) * keep
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


def compute_policy_loss_kl_cov(
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
    """KL-Cov (https://arxiv.org/abs/2505.22617): l = -A * ratio (ratio unclamped, no clip), plus
    ppo_kl_coef * |logp - old| on the max(1, int(kl_cov_ratio * #valid)) valid tokens of largest
    covariance (A - mean A) * (logp - mean logp) (plain means over the valid tokens).
    ppo_kl is the masked mean of |logp - old| (verl's metric)."""
    config, global_batch = check_loss_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    if not config.kl_cov_ratio > 0:
        raise ValueError(f"policy_loss.kl_cov_ratio must be > 0 for kl_cov, got {config.kl_cov_ratio}")
    mask = response_mask.float()
    log_ratio = log_prob - old_log_prob
    abs_kl = log_ratio.abs()
    pg_losses = -advantages * torch.exp(log_ratio)
    valid = mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    if len(flat_valid) > 0:
        with torch.no_grad():
            adv_v, logp_v = advantages[valid].reshape(-1), log_prob[valid].reshape(-1)
            cov = (adv_v - adv_v.mean()) * (logp_v - logp_v.mean())
            top = torch.topk(cov, max(1, int(len(cov) * config.kl_cov_ratio)), largest=True).indices
        penalised = torch.zeros(pg_losses.numel(), dtype=torch.bool, device=pg_losses.device)
        penalised[flat_valid[top]] = True
        pg_losses = torch.where(penalised.view_as(pg_losses), pg_losses + config.ppo_kl_coef * abs_kl, pg_losses)
    metrics = {"actor/ppo_kl": ops.masked_mean(abs_kl.detach(), mask).item()}
    pg_losses = apply_token_weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                                    metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics
