"""RL algorithms with verl's names and numbers: advantage estimators, policy and value losses, KL
estimators and controllers, loss aggregation, dynamic sampling (docs/algorithms.md).

Registries map config names to functions: ``algorithm.adv_estimator`` (``register_adv_estimator``)
and ``actor_rollout_ref.actor.policy_loss`` (``register_policy_loss``).
"""

from megatron_rl.algos.advantage import compute_advantage
from megatron_rl.algos.dynamic_sampling import filter_zero_variance_groups
from megatron_rl.algos.estimators import (
    ADV_ESTIMATOR_REGISTRY,
    AdvantageEstimator,
    EstimatorTraits,
    get_adv_estimator_fn,
    get_estimator_traits,
    register_adv_est,
    compute_gae_advantage_return,
    compute_grpo_vectorized_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    list_adv_estimators,
    register_adv_estimator,
)
from megatron_rl.algos.grouping import group_ids_from_uids
from megatron_rl.algos.kl import (
    KL_PENALTIES,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    get_kl_controller,
    kl_penalty,
)
from megatron_rl.algos.loss_agg import LOCAL_BATCH, LOSS_AGG_MODES, GlobalBatchInfo, agg_loss, masked_sum
from megatron_rl.algos.policy_loss import (
    POLICY_LOSS_REGISTRY,
    get_policy_loss_fn,
    PolicyLoss,
    PolicyLossConfig,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss,
    list_policy_losses,
    register_policy_loss,
)
from megatron_rl.algos.rewards import apply_kl_penalty, rewards_from_scores
from megatron_rl.algos import rollout_corr  # noqa: F401  (registers the `bypass_mode` policy loss)
from megatron_rl.algos.value_loss import compute_entropy_loss, compute_kl_loss, compute_value_loss

__all__ = [
    "ADV_ESTIMATOR_REGISTRY",
    "POLICY_LOSS_REGISTRY",
    "AdvantageEstimator",
    "EstimatorTraits",
    "get_adv_estimator_fn",
    "get_estimator_traits",
    "get_policy_loss_fn",
    "register_adv_est",
    "KL_PENALTIES",
    "LOCAL_BATCH",
    "LOSS_AGG_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "GlobalBatchInfo",
    "KLController",
    "PolicyLoss",
    "PolicyLossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_vectorized_outcome_advantage",
    "compute_rloo_vectorized_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_kl_loss",
    "compute_policy_loss_gspo",
    "compute_policy_loss_vanilla",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_value_loss",
    "filter_zero_variance_groups",
    "get_adv_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "group_ids_from_uids",
    "kl_penalty",
    "list_adv_estimators",
    "list_policy_losses",
    "masked_sum",
    "register_adv_estimator",
    "register_policy_loss",
    "rewards_from_scores",
]
