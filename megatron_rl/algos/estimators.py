"""Advantage estimators with verl's names, arguments and numbers (verl 0.9 ``core_algos``).

Each returns ``(advantages, returns)``, both [B, T] fp32. The per-timestep and per-group work runs
in ``megatron_rl.ops`` (GAE scan, whitening, group statistics); this module maps verl's interface
onto those ops. Register your own with ``@register_adv_estimator("name")``: ``compute_advantage``
passes each parameter by name (see ``megatron_rl.algos.advantage``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from megatron_rl import ops
from megatron_rl.algos._checks import check_finite, check_per_sample, check_token_tensors
from megatron_rl.algos.config_view import AlgoConfigLike
from megatron_rl.algos.grouping import group_ids_from_uids
from megatron_rl.algos.registry import Registry

AdvantageEstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
UidArray = np.ndarray | Sequence | torch.Tensor


class AdvantageEstimator(str, Enum):
    """verl's enum of estimator names; any member is accepted wherever a name is (registry, config)."""

    GAE = "gae"
    GRPO = "grpo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"
    RLOO = "rloo"
    GPG = "gpg"


@dataclass(frozen=True)
class EstimatorTraits:
    """What an estimator needs from the run, declared when it is registered (read by plan/validate.py
    and the trainer instead of lists of names).

    needs_critic: reads ``values`` (a critic must be enabled).
    needs_groups: compares the responses of one prompt (``index`` = uid; rollout.n must be > 1).
    needs_greedy_baseline: reads ``reward_baselines`` (the trainer generates a greedy response per prompt).
    """

    needs_critic: bool = False
    needs_groups: bool = False
    needs_greedy_baseline: bool = False


def infer_traits(fn: Callable) -> EstimatorTraits:
    """Traits from the parameter names (the way compute_advantage binds them): ``values`` -> critic,
    ``index`` -> groups, ``reward_baselines`` -> greedy baseline."""
    try:
        params = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return EstimatorTraits()
    return EstimatorTraits("values" in params, "index" in params, "reward_baselines" in params)


_ESTIMATORS: Registry[AdvantageEstimatorFn] = Registry(
    "advantage estimator", "algorithm.adv_estimator", describe=infer_traits
)
# verl's name: a mutable mapping (``ADV_ESTIMATOR_REGISTRY["x"] = fn`` registers with inferred traits).
ADV_ESTIMATOR_REGISTRY = _ESTIMATORS


def register_adv_estimator(
    name: str | Enum,
    *,
    needs_critic: Optional[bool] = None,
    needs_groups: Optional[bool] = None,
    needs_greedy_baseline: Optional[bool] = None,
) -> Callable[[AdvantageEstimatorFn], AdvantageEstimatorFn]:
    """Decorator: make ``fn`` selectable as ``algorithm.adv_estimator=name`` (a str or Enum member).

    Traits left None are inferred from the parameter names (``infer_traits``); pass them to override.
    """

    def decorator(fn: AdvantageEstimatorFn) -> AdvantageEstimatorFn:
        inferred = infer_traits(fn)
        traits = EstimatorTraits(
            inferred.needs_critic if needs_critic is None else bool(needs_critic),
            inferred.needs_groups if needs_groups is None else bool(needs_groups),
            inferred.needs_greedy_baseline if needs_greedy_baseline is None else bool(needs_greedy_baseline),
        )
        return _ESTIMATORS.register(name, traits)(fn)

    return decorator


def register_adv_est(name_or_enum: str | Enum) -> Callable[[AdvantageEstimatorFn], AdvantageEstimatorFn]:
    """verl's spelling of ``register_adv_estimator`` (traits inferred from the parameter names)."""
    return register_adv_estimator(name_or_enum)


def get_adv_estimator(name: str | Enum) -> AdvantageEstimatorFn:
    return _ESTIMATORS.lookup(name)


get_adv_estimator_fn = get_adv_estimator  # verl's name


def get_estimator_traits(name: str | Enum) -> EstimatorTraits:
    """The traits of a registered estimator (ValueError naming the known ones when unknown)."""
    return _ESTIMATORS.meta(name)


def list_adv_estimators() -> list[str]:
    return _ESTIMATORS.names()


def _outcome_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-response score s_i = sum_t r_it (verl sums all columns, masked or not)."""
    check_token_tensors(token_level_rewards=token_level_rewards, response_mask=response_mask)
    scores = ops.row_sums(token_level_rewards)
    check_finite("token_level_rewards", scores)
    return scores


def _group_outcome(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: UidArray, mode: str, epsilon: float
) -> torch.Tensor:
    """Group-normalised outcome score per response, [B] fp32."""
    scores = _outcome_scores(token_level_rewards, response_mask)
    groups, _ = group_ids_from_uids(index, scores.shape[0], scores.device)
    return ops.group_normalize(scores, groups, mode=mode, epsilon=epsilon)


@register_adv_estimator(AdvantageEstimator.GAE, needs_critic=True)
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE; returns = advantages + values before whitening, advantages whitened over the mask.

    Masked tokens (multi-turn observations) carry the next value and the running advantage through.
    """
    check_token_tensors(token_level_rewards=token_level_rewards, values=values, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards)
    check_finite("values", values)
    advantages, returns = ops.masked_gae(token_level_rewards, values, response_mask, gamma, lam)
    return ops.masked_whiten(advantages, response_mask.float()), returns


@register_adv_estimator(AdvantageEstimator.GRPO, needs_groups=True)
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: UidArray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: AlgoConfigLike = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: a_i = (s_i - mean_g) / (std_g + epsilon), unbiased std, broadcast over the response.

    A group of one uses mean 0 and std 1. ``norm_adv_by_std_in_grpo=False`` gives s_i - mean_g
    (Dr.GRPO). ``index`` holds one uid (str or int) per response. returns = advantages.
    ``config`` (verl's AlgoConfig) is accepted for verl's signature and unused, as in verl.
    """
    mode = "grpo" if norm_adv_by_std_in_grpo else "grpo_mean"
    per_response = _group_outcome(token_level_rewards, response_mask, index, mode, epsilon)
    advantages = ops.masked_broadcast(per_response, response_mask)
    return advantages, advantages


@register_adv_estimator(AdvantageEstimator.RLOO, needs_groups=True)
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: UidArray,
    epsilon: float = 1e-6,
    config: AlgoConfigLike = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: a_i = s_i * n/(n-1) - mean_g * n/(n-1) (leave-one-out baseline); a group of one keeps s_i.

    ``epsilon``, ``config`` and extra keywords are accepted for verl's signature and unused, as in verl.
    """
    per_response = _group_outcome(token_level_rewards, response_mask, index, "rloo", epsilon)
    advantages = per_response.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator(AdvantageEstimator.GPG, needs_groups=True)
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: UidArray,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    config: AlgoConfigLike = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Group Policy Gradient): a_i = alpha (s_i - mean_g) / f_norm with alpha = B / #{s_i != 0} over the
    batch (at least 1), which scales up the batches where few responses score; a group of one keeps s_i.
    ``epsilon`` and ``config`` are accepted for verl's signature and unused, as in verl."""
    scores = _outcome_scores(token_level_rewards, response_mask)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    per_response = _group_outcome(token_level_rewards, response_mask, index, "grpo_mean", epsilon)
    advantages = (alpha * per_response / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_estimator(AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE, needs_groups=True)
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: UidArray,
    epsilon: float = 1e-6,
    config: AlgoConfigLike = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: s_i - mean_g (0 for a group of one), broadcast, whitened over the whole
    batch's valid tokens, masked. ``epsilon``, ``config`` and extra keywords are accepted for verl's
    signature and unused, as in verl."""
    per_response = _group_outcome(token_level_rewards, response_mask, index, "grpo_mean", epsilon)
    mask = response_mask.float()
    advantages = ops.masked_whiten(per_response.unsqueeze(-1) * mask, mask) * mask
    return advantages, advantages


@register_adv_estimator(AdvantageEstimator.REINFORCE_PLUS_PLUS)
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfigLike | float | None = None,
    *,
    gamma: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted return-to-go over valid tokens (masked tokens carry it through, and
    hold 0), advantages = whitened returns, masked.

    The discount is ``gamma=`` when given, else ``config.gamma`` (verl's order: the 3rd argument is
    the algorithm config). A number in the config slot is taken as gamma (megatron-rl's earlier order).
    """
    gamma = _discount(config, gamma)
    check_token_tensors(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_finite("token_level_rewards", token_level_rewards)
    mask = response_mask.float()
    # GAE with values = 0 and lam = 1 runs exactly this recursion: R = (r_t + gamma*R)*m_t + (1-m_t)*R.
    # Masked slots keep the carried R in GAE's output; REINFORCE++ reports 0 there.
    running, _ = ops.masked_gae(token_level_rewards, torch.zeros_like(mask), mask, gamma, 1.0)
    returns = running * mask
    return ops.masked_whiten(returns, mask) * mask, returns


def _discount(config: AlgoConfigLike | float | None, gamma: Optional[float]) -> float:
    if gamma is None and isinstance(config, (int, float)) and not isinstance(config, bool):
        return float(config)
    if gamma is None:
        gamma = getattr(config, "gamma", None)
    if gamma is None:
        raise ValueError(
            "reinforce_plus_plus needs the discount: pass gamma= or a config with gamma (algorithm.gamma)"
        )
    return float(gamma)


@register_adv_estimator(AdvantageEstimator.REMAX, needs_greedy_baseline=True)
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
    config: AlgoConfigLike = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: returns = reverse cumulative sum of masked rewards; advantages = returns - b_i * mask,
    b_i = the greedy response's score (``batch["reward_baselines"]``, [B])."""
    batch_size, _ = check_token_tensors(token_level_rewards=token_level_rewards, response_mask=response_mask)
    check_per_sample("reward_baselines", reward_baselines, batch_size)
    check_finite("token_level_rewards", token_level_rewards)
    check_finite("reward_baselines", reward_baselines)
    mask = response_mask.float()
    returns = (token_level_rewards.float() * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - reward_baselines.float().unsqueeze(-1) * mask, returns


@register_adv_estimator("grpo_vectorized", needs_groups=True)
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: UidArray,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: AlgoConfigLike = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized GRPO: the same numbers as ``grpo`` (ours is vectorized already)."""
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo)


@register_adv_estimator("rloo_vectorized", needs_groups=True)
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: UidArray,
    epsilon: float = 1e-6,
    config: AlgoConfigLike = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorized RLOO: as ``rloo`` except that a group of one gets 0 (verl's ``rloo`` keeps s)."""
    advantages, _ = compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon)
    groups, num_groups = group_ids_from_uids(index, advantages.shape[0], advantages.device)
    sizes = torch.bincount(groups, minlength=num_groups)[groups]
    advantages = advantages * (sizes > 1).to(advantages.dtype).unsqueeze(-1)
    return advantages, advantages
