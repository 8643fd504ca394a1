"""``verl.trainer.ppo.core_algos`` with verl's names, signatures and positional order, backed by
``megatron_rl.algos`` (and its fused ops). Registering here registers in megatron-rl: an estimator
added with ``register_adv_est`` is selectable as ``algorithm.adv_estimator`` and validated by its
traits (inferred from its parameter names: values -> critic, index -> groups, reward_baselines ->
greedy baseline).

``ADV_ESTIMATOR_REGISTRY`` / ``POLICY_LOSS_REGISTRY`` are megatron-rl's registries, mutable like
verl's dicts; the four register/get functions read this module's attribute at call time, as verl's
do, so code that rebinds it to a dict of its own (verl's tests do) gets verl's behaviour on that dict.

Differences kept on purpose (docs/algorithms.md): a config of ``None`` means the defaults
(verl asserts); an all-masked batch aggregates to 0, not NaN; estimators verl has and we do not
(opo, grpo_passk, gpg, gdpo, optimal_token_baseline, *_vectorized) are absent, so
``get_adv_estimator_fn`` names the known ones. Every policy loss verl 0.9.1 registers is here
(``compute_policy_loss_<mode>``, megatron_rl.algos.policy_loss); geo_mean divides by the global batch
size when one is given (verl: the micro-batch's rows).
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, MutableMapping, Optional

import torch

from megatron_rl import algos, ops
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
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    compute_rloo_vectorized_outcome_advantage,
    get_kl_controller,
    kl_penalty,
)
from megatron_rl.algos.loss_agg import GlobalBatchInfo
from megatron_rl.algos.policy_loss import (
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_geo_mean,
    compute_policy_loss_gpg,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
)
from megatron_rl.algos.registry import Registry, key_name
from megatron_rl.algos.rollout_corr import compute_policy_loss_bypass_mode, compute_policy_loss_reinforce

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
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_reinforce",
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


def _module_registry(name: str) -> MutableMapping[str, Any]:
    return globals()[name]  # looked up per call: verl code may rebind the module attribute


def register_adv_est(name_or_enum: str | Enum) -> Callable:
    """verl's decorator: a different function under a taken name is a ValueError, the same one is a
    no-op. In megatron-rl's registry the traits are inferred from the parameter names."""
    registry = _module_registry("ADV_ESTIMATOR_REGISTRY")
    if isinstance(registry, Registry):
        return algos.register_adv_est(name_or_enum)
    name = key_name(name_or_enum)

    def decorator(fn: Callable) -> Callable:
        if name in registry and registry[name] != fn:
            raise ValueError(f"Adv estimator {name} has already been registered: {registry[name]} vs {fn}")
        registry[name] = fn
        return fn

    return decorator


def get_adv_estimator_fn(name_or_enum: str | Enum) -> Callable:
    registry = _module_registry("ADV_ESTIMATOR_REGISTRY")
    name = key_name(name_or_enum)
    if isinstance(registry, Registry) or name in registry:
        return registry.lookup(name) if isinstance(registry, Registry) else registry[name]
    # verl's wording (its tests match it), plus what is known
    raise ValueError(f"Unknown advantage estimator simply: {name} (algorithm.adv_estimator); known: {list(registry)}")


def register_policy_loss(name: str) -> Callable:
    """verl's decorator: registering a taken name replaces the entry (megatron_rl.algos.register_policy_loss
    refuses instead)."""
    registry = _module_registry("POLICY_LOSS_REGISTRY")

    def decorator(fn: Callable) -> Callable:
        registry[name] = fn
        return fn

    return decorator


def get_policy_loss_fn(name: str) -> Callable:
    registry = _module_registry("POLICY_LOSS_REGISTRY")
    if name not in registry:
        raise ValueError(
            f"Unsupported loss mode: {name} (actor_rollout_ref.actor.policy_loss.loss_mode). "
            f"Supported modes are: {list(registry)}"
        )
    return registry[name]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: Optional[int] = None,
    global_batch_size: Optional[int] = None,
    loss_scale_factor: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's signature (the global-batch normalisers as separate arguments, in verl's order) on
    ``megatron_rl.algos.compute_value_loss`` (which takes them as one ``GlobalBatchInfo``)."""
    global_batch = GlobalBatchInfo(batch_num_tokens, global_batch_size, dp_size, loss_scale_factor)
    return algos.compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode, global_batch)
