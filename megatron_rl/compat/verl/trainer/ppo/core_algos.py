"""``verl.trainer.ppo.core_algos`` with verl's names, signatures and positional order, backed by
``megatron_rl.algos`` (and its fused ops). Registering here registers in megatron-rl: an estimator
added with ``register_adv_est`` is selectable as ``algorithm.adv_estimator`` and validated by its
traits (inferred from its parameter names: values -> critic, index -> groups, reward_baselines ->
greedy baseline).

Differences kept on purpose (docs/algorithms.md): a config of ``None`` means the defaults
(verl asserts); an all-masked batch aggregates to 0, not NaN; estimators verl has and we do not
(opo, grpo_passk, gpg, gdpo, optimal_token_baseline, *_vectorized) are absent, so
``get_adv_estimator_fn`` names the known ones.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl import ops
from megatron_rl.algos import (
    ADV_ESTIMATOR_REGISTRY,
    POLICY_LOSS_REGISTRY,
    AdaptiveKLController,
    AdvantageEstimator,
    FixedKLController,
    agg_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_grpo_vectorized_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_value_loss,
    get_adv_estimator_fn,
    get_kl_controller,
    get_policy_loss_fn,
    kl_penalty,
    register_adv_est,
    register_policy_loss,
)
from megatron_rl.algos.rollout_corr import compute_policy_loss_bypass_mode

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "FixedKLController",
    "agg_loss",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_policy_loss_bypass_mode",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rewards",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "get_adv_estimator_fn",
    "get_kl_controller",
    "get_policy_loss_fn",
    "kl_penalty",
    "register_adv_est",
    "register_policy_loss",
]


def compute_rewards(
    token_level_scores: torch.Tensor, old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kl_ratio: float
) -> torch.Tensor:
    """token_level_scores - kl_ratio * (old_log_prob - ref_log_prob) (verl's k1 reward penalty)."""
    return token_level_scores - (old_log_prob - ref_log_prob) * kl_ratio


def compute_entropy_loss(logits: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> Any:
    """verl's signature: per-token entropy of ``logits`` [B, T, V], aggregated over ``response_mask``.
    (megatron_rl.algos.compute_entropy_loss takes the entropy itself, computed from vocab-sharded logits.)"""
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return agg_loss(entropy, response_mask, loss_agg_mode)


masked_mean = ops.masked_mean
