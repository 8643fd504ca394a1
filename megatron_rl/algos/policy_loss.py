"""Policy-gradient losses by name ("vanilla" PPO clip, "gspo", "decoupled_ppo", and verl 0.9's other
loss modes: "dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean" (GMPO), "dro", "cispo"),
with truncated importance sampling against the rollout engine's log-probs as an opt-in correction for
rollout/trainer mismatch.

Every loss has one signature, ``PolicyLoss``, and returns ``(loss, metrics)`` with verl's metric
names actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl. This module is the registry and the
losses' public face; they live by family in policy_loss_clip (PPO clip, dual clip, decoupled PPO, SAPO,
Clip-Cov / KL-Cov), policy_loss_sequence (GSPO, GMPO) and policy_loss_pg (GPG, DRO, CISPO, DPPO), their
settings in policy_loss_config and what they share in policy_loss_common.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from megatron_rl.algos.config_view import ActorConfigLike
from megatron_rl.algos.loss_agg import GlobalBatchInfo
from megatron_rl.algos.policy_loss_clip import (
    compute_policy_loss_clip_cov,
    compute_policy_loss_decoupled_ppo,
    compute_policy_loss_kl_cov,
    compute_policy_loss_sapo,
    compute_policy_loss_vanilla,
)
from megatron_rl.algos.policy_loss_config import PolicyLossConfig
from megatron_rl.algos.policy_loss_pg import (
    compute_policy_loss_cispo,
    compute_policy_loss_dppo_kl,
    compute_policy_loss_dppo_tv,
    compute_policy_loss_dro,
    compute_policy_loss_gpg,
)
from megatron_rl.algos.policy_loss_sequence import compute_policy_loss_geo_mean, compute_policy_loss_gspo
from megatron_rl.algos.registry import Registry

__all__ = [
    "POLICY_LOSS_REGISTRY",
    "PolicyLoss",
    "PolicyLossConfig",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_decoupled_ppo",
    "compute_policy_loss_dppo_kl",
    "compute_policy_loss_dppo_tv",
    "compute_policy_loss_dro",
    "compute_policy_loss_geo_mean",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_kl_cov",
    "compute_policy_loss_sapo",
    "compute_policy_loss_vanilla",
    "get_policy_loss",
    "get_policy_loss_fn",
    "list_policy_losses",
    "register_policy_loss",
]


class PolicyLoss(Protocol):
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = ...,
        config: PolicyLossConfig | ActorConfigLike | None = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
        *,
        rollout_log_probs: Optional[torch.Tensor] = None,
        global_batch: Optional[GlobalBatchInfo] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


_POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss")
POLICY_LOSS_REGISTRY = _POLICY_LOSSES  # verl's name: a mutable mapping (assignment replaces, as in verl)


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make ``fn`` (a ``PolicyLoss``) selectable as ``actor.policy_loss=name``; a taken name
    is refused (verl's ``register_policy_loss``, in compat, replaces instead)."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLoss:
    return _POLICY_LOSSES.lookup(name)


get_policy_loss_fn = get_policy_loss  # verl's name


def list_policy_losses() -> list[str]:
    return _POLICY_LOSSES.names()


# in the order list_policy_losses (and so every "known:" message) shows them
_BUILT_IN_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "decoupled_ppo": compute_policy_loss_decoupled_ppo,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "geo_mean": compute_policy_loss_geo_mean,
    "dro": compute_policy_loss_dro,
    "cispo": compute_policy_loss_cispo,
}


def _register_built_ins() -> None:
    for name, loss in _BUILT_IN_LOSSES.items():
        register_policy_loss(name)(loss)


_register_built_ins()
