"""Policy-gradient losses by name ("vanilla" PPO clip, "gspo", "decoupled_ppo"), with truncated importance
sampling against the rollout engine's log-probs as an opt-in correction for rollout/trainer mismatch.

Every loss has one signature, ``PolicyLoss``, and returns ``(loss, metrics)`` with verl's metric
names actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Optional, Protocol

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
    behav_imp_weight_cap: decoupled_ppo only (AReaL's name): tokens whose behaviour->proximal weight
        exp(old_log_prob - rollout_log_probs) exceeds it leave the loss (weight 0); None: no cap.
    """

    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    tis_imp_ratio_cap: Optional[float] = None
    behav_imp_weight_cap: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            if value is not None and not 0 <= value:
                raise ValueError(f"actor_rollout_ref.actor.{key} must be >= 0, got {value}")
        if not self.clip_ratio_c > 1.0:
            raise ValueError(
                f"actor_rollout_ref.actor.clip_ratio_c must be > 1 (dual-clip bound), got {self.clip_ratio_c}"
            )
        for key in ("tis_imp_ratio_cap", "behav_imp_weight_cap"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"actor_rollout_ref.actor.{key} must be > 0 or null (off), got {value}")

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @classmethod
    def from_actor_config(cls, actor: Any) -> "PolicyLossConfig":
        """Read the fields of the same names from an actor config: ours (``actor_rollout_ref.actor``),
        a verl ``ActorConfig``, a DictConfig or a plain dict. Fields the config lacks keep their
        defaults (verl 0.9 has no ``tis_imp_ratio_cap``: its correction lives in
        ``algorithm.rollout_correction``)."""
        if isinstance(actor, PolicyLossConfig):
            return actor
        values = {}
        for f in fields(cls):
            value = _read(actor, f.name, _ABSENT)
            if value is not _ABSENT:
                values[f.name] = value
        return cls(**values)


_ABSENT = object()


def _read(cfg: Any, key: str, default: Any) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    try:
        return getattr(cfg, key)
    except (AttributeError, KeyError, Exception):  # DictConfig in struct mode raises its own error
        return default


def global_batch_from_config(config: Any) -> GlobalBatchInfo:
    """verl passes the mini-batch normalisers in ``config.global_batch_info`` (dp_size,
    batch_num_tokens, global_batch_size, loss_scale_factor); absent -> this call's own counts."""
    info = _read(config, "global_batch_info", None) if config is not None else None
    if not info:
        return LOCAL_BATCH
    info = dict(info)
    unknown = set(info) - {"dp_size", "batch_num_tokens", "global_num_tokens", "global_batch_size", "loss_scale_factor"}
    if unknown:
        raise ValueError(f"config.global_batch_info has unknown keys {sorted(unknown)}")
    return GlobalBatchInfo(
        global_num_tokens=info.get("batch_num_tokens", info.get("global_num_tokens")),
        global_batch_size=info.get("global_batch_size"),
        dp_size=int(info.get("dp_size", 1)),
        loss_scale_factor=info.get("loss_scale_factor"),
    )


class PolicyLoss(Protocol):
    def __call__(
        self,
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = ...,
        config: Any = None,
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


def _check_inputs(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_log_probs: Optional[torch.Tensor],
    config: Any,
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


def _dual_clip_losses(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    config: PolicyLossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token PPO clip with clip-higher and dual clip on ratio = pi / pi_old, and its metrics."""
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
    return pg_losses, metrics


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
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
    config, global_batch = _check_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    pg_losses, metrics = _dual_clip_losses(old_log_prob, log_prob, advantages, mask, config)
    pg_losses = _truncated_is(pg_losses, old_log_prob, rollout_log_probs, mask, config, metrics)
    if rollout_is_weights is not None:  # verl's rollout correction (algos/rollout_corr.py), detached
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs())
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
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
    config, global_batch = _check_inputs(
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
    pg_losses = _truncated_is(pg_losses, old_log_prob, rollout_log_probs, mask, config, metrics)
    if rollout_is_weights is not None:  # verl's rollout correction (algos/rollout_corr.py), detached
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs())
    return loss, metrics


@register_policy_loss("decoupled_ppo")
def compute_policy_loss_decoupled_ppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
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
    config, global_batch = _check_inputs(
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
