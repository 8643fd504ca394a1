"""What every policy loss shares: the input checks (which also resolve the loss settings and the
global-batch normalisers), the clamped importance ratio, and the per-token weights applied to a
loss before aggregation (truncated IS against the rollout's log-probs, verl's rollout correction).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_rl import ops
from megatron_rl.algos._checks import check_token_tensors
from megatron_rl.algos.config_view import ActorConfigLike
from megatron_rl.algos.loss_agg import GlobalBatchInfo
from megatron_rl.algos.policy_loss_config import PolicyLossConfig, global_batch_from_config

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: large enough to clip, small enough not to overflow


def check_loss_inputs(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    config: PolicyLossConfig | ActorConfigLike | None,
    rollout_is_weights: Optional[torch.Tensor] = None,
    global_batch: Optional[GlobalBatchInfo] = None,
) -> tuple[PolicyLossConfig, GlobalBatchInfo]:
    """Shapes agree, IS weights look like weights, a TIS cap has the rollout log-probs it needs;
    returns (the loss config, the global-batch normalisers), both defaulted and read from a
    verl-shaped ``config`` (``global_batch_info``) when that is what was passed."""
    tensors = dict(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
    )
    if rollout_log_probs is not None:
        tensors["rollout_log_probs"] = rollout_log_probs
    if rollout_is_weights is not None:
        if not isinstance(rollout_is_weights, torch.Tensor):
            raise ValueError(
                f"rollout_is_weights (7th positional argument, verl's order) must be a tensor, got "
                f"{type(rollout_is_weights).__name__}"
            )
        tensors["rollout_is_weights"] = rollout_is_weights
    check_token_tensors(**tensors)
    if rollout_is_weights is not None:
        valid = rollout_is_weights[response_mask.bool()]
        if valid.numel() and bool((valid < 0).any()):
            raise ValueError(
                "rollout_is_weights has negative entries (min "
                f"{valid.min().item():.4g}): importance weights are >= 0. If these are the rollout's "
                "log-probs, pass them as rollout_log_probs= (the 7th positional argument is verl's "
                "rollout_is_weights)"
            )
    if global_batch is None:
        global_batch = global_batch_from_config(config)
    config = PolicyLossConfig() if config is None else PolicyLossConfig.from_actor_config(config)
    if config.tis_imp_ratio_cap is not None and rollout_log_probs is None:
        raise ValueError(
            f"actor_rollout_ref.actor.tis_imp_ratio_cap={config.tis_imp_ratio_cap} is set but "
            "rollout_log_probs is None: the rollout must return the log-probs of the tokens it sampled"
        )
    return config, global_batch


def _truncated_is(
    pg_losses: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    mask: torch.Tensor,
    config: PolicyLossConfig,
    metrics: dict[str, float],
) -> torch.Tensor:
    """Reweight each token's loss by min(pi_old / pi_rollout, cap): the tokens were sampled by the
    rollout engine, whose numerics differ from the trainer's (https://fengyao.notion.site/off-policy-rl)."""
    if config.tis_imp_ratio_cap is None:
        return pg_losses
    weights = torch.clamp(torch.exp(old_log_prob - rollout_log_probs), max=config.tis_imp_ratio_cap).detach()
    metrics["actor/tis_weight_mean"] = ops.masked_mean(weights, mask).item()
    metrics["actor/tis_clipfrac"] = ops.masked_mean(
        (weights >= config.tis_imp_ratio_cap).float(), mask
    ).item()
    return pg_losses * weights


def apply_token_weights(
    pg_losses: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    rollout_is_weights: Optional[torch.Tensor],
    mask: torch.Tensor,
    config: PolicyLossConfig,
    metrics: dict[str, float],
) -> torch.Tensor:
    """Truncated IS (``tis_imp_ratio_cap``) and verl's rollout-correction weights on each token's loss."""
    pg_losses = _truncated_is(pg_losses, old_log_prob, rollout_log_probs, mask, config, metrics)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    return pg_losses


def clamped_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped log-ratio, ratio) as verl's clamped losses compute them."""
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)

