"""Policy-gradient losses by name ("vanilla" PPO clip, "gspo"), with truncated importance sampling
against the rollout engine's log-probs as an opt-in correction for rollout/trainer mismatch.

Every loss has one signature, ``PolicyLoss``, and returns ``(loss, metrics)`` with verl's metric
names actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Protocol

import torch

from megatron_rl import ops
from megatron_rl.algos._checks import check_token_tensors
from megatron_rl.algos.loss_agg import LOCAL_BATCH, GlobalBatchInfo, agg_loss
from megatron_rl.algos.registry import Registry

LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: large enough to clip, small enough not to overflow


@dataclass(frozen=True)
class PolicyLossConfig:
    """The actor settings the policy losses read (same names as ``actor_rollout_ref.actor.*``).

    clip_ratio_low / clip_ratio_high default to clip_ratio; different values give clip-higher (DAPO).
    clip_ratio_c: dual-clip bound for negative advantages (vanilla only), must be > 1.
    tis_imp_ratio_cap: truncated IS weight min(exp(old_log_prob - rollout_log_probs), cap) on each
        token's loss; None (default) turns it off.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    tis_imp_ratio_cap: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            if value is not None and not 0 <= value:
                raise ValueError(f"actor_rollout_ref.actor.{key} must be >= 0, got {value}")
        if not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual-clip bound), got {self.clip_ratio_c}"
            )
        if self.tis_imp_ratio_cap is not None and not self.tis_imp_ratio_cap > 0:
            raise ValueError(
                "actor_rollout_ref.actor.tis_imp_ratio_cap must be > 0 or null (off), "
                f"got {self.tis_imp_ratio_cap}"
            )

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @classmethod
    def from_actor_config(cls, actor: Any) -> "PolicyLossConfig":
        """Read the fields of the same names from ``actor_rollout_ref.actor`` (dataclass or DictConfig)."""
        return cls(**{f.name: getattr(actor, f.name) for f in fields(cls)})


class PolicyLoss(Protocol):
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = ...,
        config: Optional[PolicyLossConfig] = None,
        rollout_log_probs: Optional[torch.Tensor] = None,
        global_batch: GlobalBatchInfo = ...,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


_POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss", "actor_rollout_ref.actor.policy_loss")


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: make ``fn`` (a ``PolicyLoss``) selectable as ``actor.policy_loss=name``."""
    return _POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLoss:
    return _POLICY_LOSSES.get(name)


def list_policy_losses() -> list[str]:
    return _POLICY_LOSSES.names()


def _check_inputs(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    config: Optional[PolicyLossConfig],
) -> PolicyLossConfig:
    """Shapes agree and a TIS cap has the rollout log-probs it needs; returns the config (default if None)."""
    tensors = dict(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask
    )
    if rollout_log_probs is not None:
        tensors["rollout_log_probs"] = rollout_log_probs
    check_token_tensors(**tensors)
    config = config if config is not None else PolicyLossConfig()
    if config.tis_imp_ratio_cap is not None and rollout_log_probs is None:
        raise ValueError(
            f"actor_rollout_ref.actor.tis_imp_ratio_cap={config.tis_imp_ratio_cap} is set but "
            "rollout_log_probs is None: the rollout must return the log-probs of the tokens it sampled"
        )
    return config


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


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[PolicyLossConfig] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    global_batch: GlobalBatchInfo = LOCAL_BATCH,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped objective with clip-higher and dual clip.

    ratio = exp(clamp(logp - old, -20, 20)); l = max(-A*ratio, -A*clip(ratio, 1-low, 1+high));
    where A < 0: l = min(l, -A*clip_ratio_c). pg_clipfrac: share of tokens where the clip binds;
    pg_clipfrac_lower: share where the dual clip binds; ppo_kl: masked mean of old - logp (clamped).
    """
    config = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config)
    mask = response_mask.float()
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
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
    pg_losses = _truncated_is(pg_losses, old_log_prob, rollout_log_probs, mask, config, metrics)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs())
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Optional[PolicyLossConfig] = None,
    rollout_log_probs: Optional[torch.Tensor] = None,
    global_batch: GlobalBatchInfo = LOCAL_BATCH,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (https://arxiv.org/abs/2507.18071): one importance ratio per sequence.

    s_i = exp(mean over valid t of (logp - old)); the token-level ratio is
    sg[s_i] * pi(y_t) / sg[pi(y_t)] (value s_i, gradient through each token's log-prob), its log
    clamped at 10; l = max(-A*s, -A*clip(s, 1-low, 1+high)). No dual clip, so pg_clipfrac_lower = 0.
    """
    config = _check_inputs(old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config)
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
    pg_losses = _truncated_is(pg_losses, old_log_prob, rollout_log_probs, mask, config, metrics)
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs())
    return loss, metrics
