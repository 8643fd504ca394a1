"""Policy-gradient losses by name ("vanilla" PPO clip, "gspo", "decoupled_ppo", and verl 0.9's other
loss modes: "dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean" (GMPO), "dro", "cispo"),
with truncated importance sampling against the rollout engine's log-probs as an opt-in correction for
rollout/trainer mismatch.

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
    def from_actor_config(cls, actor: Any) -> "PolicyLossConfig":
        """Read the fields of the same names from an actor config: ours (``actor_rollout_ref.actor``),
        a verl ``ActorConfig``, a DictConfig or a plain dict. Fields the config lacks keep their
        defaults (verl 0.9 has no ``tis_imp_ratio_cap``: its correction lives in
        ``algorithm.rollout_correction``). The loss-specific keys verl nests under ``policy_loss``
        (``clip_cov_ratio`` ... ``dro_beta``) are read from ``actor.<key>`` or ``actor.policy_loss.<key>``;
        a ``None`` there, or in ``tau_pos``/``tau_neg``, keeps the default (verl's losses do the same)."""
        if isinstance(actor, PolicyLossConfig):
            return actor
        nested = _read(actor, "policy_loss", None)
        if isinstance(nested, str):
            nested = None
        values = {}
        for f in fields(cls):
            value = _read(actor, f.name, _ABSENT)
            if f.name in _NESTED_KEYS and (value is _ABSENT or value is None) and nested is not None:
                value = _read(nested, f.name, _ABSENT)
            if value is None and f.name in _NONE_KEEPS_DEFAULT:
                value = _ABSENT
            if value is not _ABSENT:
                values[f.name] = value
        return cls(**values)


_NESTED_KEYS = frozenset({"clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta"})
# the losses' own parameters: null in a config (ours: ActorConfig's defaults) keeps verl's default
_NONE_KEEPS_DEFAULT = _NESTED_KEYS | {"tau_pos", "tau_neg"}


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


# ---------------------------------------------------------------- verl 0.9's other loss modes
# Each follows verl 0.9.1's formula (same clamps, epsilons and metric names) so a verl config's
# policy_loss.loss_mode means the same thing here; docs/algorithms.md lists them.


def _weights(
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


def _ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped log-ratio, ratio) as verl's clamped losses compute them."""
    log_ratio = torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


def _dppo(kind: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
          rollout_is_weights, rollout_log_probs, global_batch):
    config, global_batch = _check_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio, ratio = _ratio(old_log_prob, log_prob)
    cap = config.clip_ratio_c
    truncated = torch.clamp(ratio, max=cap).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if kind == "tv":
        ok_pos = (prob - old_prob) <= config.high
        ok_neg = (prob - old_prob) >= -config.low
    else:  # binary KL between Bernoulli(old_prob) and Bernoulli(prob)
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        ok_pos = (binary_kl <= config.high) | (prob <= old_prob)
        ok_neg = (binary_kl <= config.low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, ok_pos, ok_neg).detach().float()
    pg_losses = -advantages * truncated * log_prob * valid
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean(1.0 - valid, mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": ops.masked_mean((ratio > cap).float() * valid, mask).item(),
    }
    pg_losses = _weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config, metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
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
    """DPPO, binary-TV trust region (https://arxiv.org/abs/2602.04879). A token leaves the loss when its
    probability moved past the region in the advantage's direction: A > 0 and p - p_old > clip_ratio_high,
    or A <= 0 and p - p_old < -clip_ratio_low (clip_ratio_* are probability differences here).
    l = -A * sg[min(ratio, clip_ratio_c)] * logp * valid. pg_clipfrac: share outside the region;
    pg_clipfrac_lower: share inside it whose ratio exceeds clip_ratio_c."""
    return _dppo("tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights, rollout_log_probs, global_batch)


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
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
    """DPPO, binary-KL trust region: as ``dppo_tv`` with the divergence
    KL(Bern(p_old) || Bern(p)) = p_old*log(p_old/p) + (1-p_old)*log((1-p_old+1e-8)/(1-p+1e-8)),
    bounded by clip_ratio_high when A > 0 and p rose, by clip_ratio_low when A <= 0 and p fell."""
    return _dppo("kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights, rollout_log_probs, global_batch)


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
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
    """SAPO (https://arxiv.org/abs/2511.20347): a soft gate instead of a clip.
    l = -A * sigmoid(tau * (ratio - 1)) * 4 / tau, tau = tau_pos where A > 0 else tau_neg. Always
    aggregated seq-mean-token-mean, whatever ``loss_agg_mode`` says (as verl); pg_clipfrac(_lower) = 0."""
    config, global_batch = _check_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio, ratio = _ratio(old_log_prob, log_prob)
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
    pg_losses = _weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config, metrics)
    return agg_loss(pg_losses, mask, "seq-mean-token-mean", **global_batch.agg_kwargs()), metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
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
    """GPG (https://arxiv.org/abs/2504.02546): plain policy gradient, l = -A * logp (no ratio, no clip;
    ``old_log_prob`` only shapes the checks). No metrics (verl returns none either)."""
    config, global_batch = _check_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    metrics: dict[str, float] = {}
    pg_losses = _weights(-log_prob * advantages, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config,
                         metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
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
    """Clip-Cov (https://arxiv.org/abs/2505.22617): the PPO clip (no dual clip, ratio unclamped), and
    additionally max(1, int(clip_cov_ratio * #valid)) tokens drawn at random (torch's global RNG, as verl)
    from those the clip did not bind on whose centred covariance (A - mean A) * (logp - mean logp) lies in
    (clip_cov_lb, clip_cov_ub) get no loss (and so no gradient). pg_clipfrac: share of tokens dropped."""
    config, global_batch = _check_inputs(
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
    pg_losses = _weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config, metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
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
    """KL-Cov (https://arxiv.org/abs/2505.22617): l = -A * ratio (ratio unclamped, no clip), plus
    ppo_kl_coef * |logp - old| on the max(1, int(kl_cov_ratio * #valid)) valid tokens of largest
    covariance (A - mean A) * (logp - mean logp) (plain means over the valid tokens).
    ppo_kl is the masked mean of |logp - old| (verl's metric)."""
    config, global_batch = _check_inputs(
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
    pg_losses = _weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config, metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
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
    """GMPO (https://arxiv.org/abs/2507.20673): the geometric mean of the token ratios per sequence.
    Each token's log-ratio d is clipped on the advantage's side, d' = sgn(A) * min(sgn(A)*d,
    sgn(A)*clip(d, -clip_ratio_low, clip_ratio_high)) (log space, unclamped otherwise);
    l_i = -mean_t(A) * exp(mean_t(d')) over valid t (denominators + 1e-8); loss = mean over rows,
    ``loss_agg_mode`` ignored (as verl). Token weights (TIS, rollout_is_weights) enter as their
    geometric mean over the sequence. With a global batch (``global_batch_size``) the rows are summed
    and divided by it (times dp_size), so micro-batches add up to the mini-batch mean; verl divides by
    the micro-batch's rows. pg_clipfrac / _lower: share of tokens whose log-ratio the clip moved, A > 0 / A < 0.
    """
    config, global_batch = _check_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -config.low, config.high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    lengths = mask.sum(dim=-1) + 1e-8
    seq_ratio = torch.exp((clipped_log_ratio * mask).sum(dim=-1) / lengths)
    seq_adv = (advantages * mask).sum(dim=-1) / lengths
    pg_losses = -seq_adv * seq_ratio
    moved = torch.ne(log_ratio, clamped)
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean((moved & (advantages > 0)).float(), mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": ops.masked_mean((moved & (advantages < 0)).float(), mask).item(),
    }
    token_weights = _weights(torch.ones_like(log_ratio), old_log_prob, rollout_log_probs, rollout_is_weights, mask,
                             config, metrics)
    if config.tis_imp_ratio_cap is not None or rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp((torch.log(token_weights + 1e-10) * mask).sum(dim=-1) / lengths)
    if global_batch.global_batch_size is None:
        loss = pg_losses.mean()
    else:
        loss = pg_losses.sum() / global_batch.global_batch_size * global_batch.dp_size
    return loss, metrics


@register_policy_loss("dro")
def compute_policy_loss_dro(
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
    """Direct Reward Optimization (https://arxiv.org/abs/2405.19107) as verl 0.9.1 has it: policy gradient
    with a quadratic log-ratio penalty, l = -(A * logp - dro_beta/2 * (logp - old)^2); ``dro_beta``
    (``actor.policy_loss.dro_beta``) must be set > 0."""
    config, global_batch = _check_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    beta = config.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"policy_loss.dro_beta must be a positive value when using DRO, got {beta}")
    mask = response_mask.float()
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * beta * log_ratio.square())
    metrics = {"actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item()}
    pg_losses = _weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config, metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
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
    """CISPO (MiniMax-M1, https://arxiv.org/abs/2506.13585): clip the IS weight, not the update, so every
    token keeps a gradient. l = -sg[clip(ratio, 1-clip_ratio_low, 1+clip_ratio_high)] * A * logp,
    ratio = exp(clamp(logp - old, -20, 20)). pg_clipfrac: share of tokens whose weight was clipped;
    pg_clipfrac_lower = 0."""
    config, global_batch = _check_inputs(
        old_log_prob, log_prob, advantages, response_mask, rollout_log_probs, config, rollout_is_weights, global_batch
    )
    mask = response_mask.float()
    log_ratio, ratio = _ratio(old_log_prob, log_prob)
    weight = torch.clamp(ratio, 1 - config.low, 1 + config.high)
    pg_losses = -weight.detach() * advantages * log_prob
    metrics = {
        "actor/pg_clipfrac": ops.masked_mean((ratio != weight).float(), mask).item(),
        "actor/ppo_kl": ops.masked_mean(-log_ratio.detach(), mask).item(),
        "actor/pg_clipfrac_lower": 0.0,
    }
    pg_losses = _weights(pg_losses, old_log_prob, rollout_log_probs, rollout_is_weights, mask, config, metrics)
    return agg_loss(pg_losses, mask, loss_agg_mode, **global_batch.agg_kwargs()), metrics
