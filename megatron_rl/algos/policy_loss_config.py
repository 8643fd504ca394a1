"""The settings the policy losses read (``PolicyLossConfig``) and the mini-batch normalisers
(``global_batch_from_config``), both taken from the actor config a loss is handed.

What a loss is handed as ``config`` varies with its caller: our trainer passes a ``PolicyLossConfig``;
verl code and verl-shaped tests pass an actor config (verl's ``ActorConfig``, a DictConfig, a plain
dict). Everything here reads those by attribute; a plain dict is viewed by attribute first.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from megatron_rl.algos.config_view import ActorConfigLike, by_attribute
from megatron_rl.algos.loss_agg import LOCAL_BATCH, GlobalBatchInfo


@dataclass(frozen=True)
class PolicyLossConfig:
    """The actor settings the policy losses read (same names as ``actor_rollout_ref.actor.*``).

    clip_ratio_low / clip_ratio_high default to clip_ratio; different values give clip-higher (DAPO).
    clip_ratio_c: dual-clip bound for negative advantages (vanilla only), must be > 1.
    tis_imp_ratio_cap: truncated IS weight min(exp(old_log_prob - rollout_log_probs), cap) on each
        token's loss; None (default) turns it off.
    behav_imp_weight_cap: decoupled_ppo only (AReaL's name): tokens whose behaviour->proximal weight
        exp(old_log_prob - rollout_log_probs) exceeds it leave the loss (weight 0); None: no cap.
    tau_pos / tau_neg: sapo's gate temperatures for A > 0 / A <= 0 (verl's actor.tau_pos/tau_neg).
    clip_cov_ratio / clip_cov_lb / clip_cov_ub: clip_cov's share of tokens to drop and the covariance
        window they are drawn from; kl_cov_ratio / ppo_kl_coef: kl_cov's share of tokens that get the
        |log-ratio| penalty and its weight; dro_beta: dro's quadratic log-ratio penalty (required by dro).
        verl keeps these six in ``actor.policy_loss.*``; they are read from there too (``from_actor_config``).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    tis_imp_ratio_cap: Optional[float] = None
    behav_imp_weight_cap: Optional[float] = None
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None

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
    def from_actor_config(cls, actor: PolicyLossConfig | ActorConfigLike) -> PolicyLossConfig:
        """Read the fields of the same names from an actor config: ours (``actor_rollout_ref.actor``),
        a verl ``ActorConfig``, a DictConfig or a plain dict. Fields the config lacks keep their
        defaults (verl 0.9 has no ``tis_imp_ratio_cap``: its correction lives in
        ``algorithm.rollout_correction``). The loss-specific keys verl nests under ``policy_loss``
        (``clip_cov_ratio`` ... ``dro_beta``) are read from ``actor.<key>`` or ``actor.policy_loss.<key>``;
        a ``None`` there, or in ``tau_pos``/``tau_neg``, keeps the default (verl's losses do the same)."""
        if isinstance(actor, PolicyLossConfig):
            return actor
        actor = by_attribute(actor)
        nested = getattr(actor, "policy_loss", None)
        nested = None if isinstance(nested, str) else by_attribute(nested)  # ours: the loss's name
        values = {}
        for f in fields(cls):
            value = getattr(actor, f.name, _ABSENT)
            if f.name in _NESTED_KEYS and (value is _ABSENT or value is None) and nested is not None:
                value = getattr(nested, f.name, _ABSENT)
            if value is None and f.name in _NONE_KEEPS_DEFAULT:
                value = _ABSENT
            if value is not _ABSENT:
                values[f.name] = value
        return cls(**values)


_NESTED_KEYS = frozenset({"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta"})
# the losses' own parameters: null in a config (ours: ActorConfig's defaults) keeps verl's default
_NONE_KEEPS_DEFAULT = _NESTED_KEYS | {"tau_pos", "tau_neg"}


_ABSENT = object()


def global_batch_from_config(config: PolicyLossConfig | ActorConfigLike | None) -> GlobalBatchInfo:
    """verl passes the mini-batch normalisers in ``config.global_batch_info`` (dp_size,
    batch_num_tokens, global_batch_size, loss_scale_factor); absent -> this call's own counts."""
    info = getattr(by_attribute(config), "global_batch_info", None)
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
