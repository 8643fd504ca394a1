"""Rollout correction (verl's ``rollout_corr``): the tokens were sampled by the rollout engine, whose
numbers differ from the trainer's (bf16 kernels, another parallel layout, stale weights). With
``log_ratio = old_log_prob - rollout_log_probs`` per token:

- importance weights (``rollout_is``): ``"token"`` w_t = exp(log_ratio_t); ``"sequence"`` one weight
  exp(sum_t log_ratio_t) per response. ``rollout_is_threshold`` = a float (or "2.0"): truncate at that
  value (TIS); ``"lower_upper"`` (e.g. "0.5_5.0"): weights outside [lower, upper] become 0 (IcePop
  masking). ``rollout_is_batch_normalize``: divide by the batch mean. The weights multiply each
  token's policy loss (``compute_policy_loss_*``'s 7th argument, ``rollout_is_weights``), detached.
- rejection (``rollout_rs``, comma-separated options, ``rollout_rs_threshold`` one spec or one per
  option): ``token_k1|k2|k3``, ``seq_sum_k1|k2|k3``, ``seq_mean_k1|k2|k3``, ``seq_max_k2|k3`` with
  k1 = -log r (bounds "lower_upper" on the ratio, or one float u meaning [1/u, u]), k2 = 0.5 log^2 r,
  k3 = r - 1 - log r (upper bound). Rejected tokens (a whole response for seq_* options) leave
  ``response_mask``.
- bypass mode (``bypass_mode=true``): the trainer skips the old-log-prob pass and uses the rollout's
  log-probs as ``old_log_probs`` (two policies, not three); the PPO ratio is then pi/pi_rollout.

Numbers and metric names (``rollout_corr/rollout_is_mean`` ...) follow verl 0.9
(verl/trainer/ppo/rollout_corr_helper.py); tests/algos/test_rollout_corr.py compares with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_rl import ops
from megatron_rl.algos._checks import check_token_tensors

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
LOSS_TYPES = ("ppo_clip", "reinforce")
KEY = "algorithm.rollout_correction"


def parse_is_threshold(spec: Any) -> tuple[float, Optional[float]]:
    """(upper, lower): a number -> (x, None) = truncation; "lower_upper" -> masking outside [lower, upper]."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{KEY}.rollout_is_threshold must be a number or 'lower_upper', got {spec!r}")
    lower: Optional[float] = None
    try:
        if isinstance(spec, str) and "_" in spec:
            low_s, up_s = spec.strip().split("_", 1)
            lower, upper = float(low_s), float(up_s)
        else:
            upper = float(spec)
    except ValueError:
        raise ValueError(f"{KEY}.rollout_is_threshold={spec!r} is neither a number nor 'lower_upper'") from None
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"{KEY}.rollout_is_threshold={spec!r}: need 0 < lower <= upper, upper > 0")
    return upper, lower


def parse_rs(options: Any, spec: Any) -> list[tuple[str, Optional[float], float]]:
    """[(option, lower, upper)] for a comma-separated ``rollout_rs`` and its ``rollout_rs_threshold``."""
    names: list[str] = []
    for name in (o.strip() for o in str(options).split(",")):
        if not name:
            continue
        if name not in RS_OPTIONS:
            raise ValueError(f"{KEY}.rollout_rs has unknown option {name!r}; known: {list(RS_OPTIONS)}")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"{KEY}.rollout_rs={options!r} names no option; known: {list(RS_OPTIONS)}")
    if spec is None:
        raise ValueError(f"{KEY}.rollout_rs={options!r} needs {KEY}.rollout_rs_threshold")
    specs = [s.strip() for s in str(spec).split(",") if s.strip()] if isinstance(spec, str) else [str(spec)]
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"{KEY}.rollout_rs_threshold={spec!r} gives {len(specs)} thresholds for {len(names)} options {names}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, s in zip(names, specs):
        try:
            if name.endswith("k1"):
                low, up = (float(x) for x in s.split("_", 1)) if "_" in s else (1.0 / float(s), float(s))
            else:
                low, up = None, float(s)
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{KEY}.rollout_rs_threshold {s!r} for {name} is not a threshold") from None
        if not up > 0 or (low is not None and not 0 < low <= up):
            raise ValueError(f"{KEY}.rollout_rs_threshold {s!r} for {name}: need 0 < lower <= upper")
        out.append((name, low, up))
    return out


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's ``algorithm.rollout_correction`` keys, checked."""

    rollout_is: Optional[str] = None
    rollout_is_threshold: Any = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: Optional[str] = None
    rollout_rs_threshold: Any = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"{KEY}.rollout_is must be one of {list(IS_LEVELS)} or null, got {self.rollout_is!r}")
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_rs is not None:
            parse_rs(self.rollout_rs, self.rollout_rs_threshold)
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"{KEY}.loss_type must be one of {list(LOSS_TYPES)}, got {self.loss_type!r}")

    @classmethod
    def from_config(cls, cfg: Any) -> "RolloutCorrection":
        if cfg is None:
            return cls()
        if isinstance(cfg, RolloutCorrection):
            return cfg
        get = cfg.get if hasattr(cfg, "get") else (lambda k, d=None: getattr(cfg, k, d))
        known = cls.__dataclass_fields__
        keys = list(cfg.keys()) if hasattr(cfg, "keys") else list(known)
        unknown = [k for k in keys if k not in known and not str(k).startswith("_")]
        if unknown:
            raise ValueError(f"{KEY} has unknown keys {unknown}; known: {list(known)}")
        return cls(**{k: get(k, f.default) for k, f in known.items()})

    @property
    def enabled(self) -> bool:
        """Anything to compute (weights, a rejection mask or bypass)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: Any = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """IS weights [B, T] (0 on padding, detached) and metrics (unprefixed, verl's names)."""
    if rollout_is not in IS_LEVELS:
        raise ValueError(f"{KEY}.rollout_is must be one of {list(IS_LEVELS)}, got {rollout_is!r}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    mask = response_mask.to(log_ratio.dtype)
    if rollout_is == "token":
        log_w = log_ratio
    else:
        log_w = (log_ratio * mask).sum(dim=-1, keepdim=True)
    raw = torch.exp(torch.clamp(log_w, -SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio) * mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    valid = mask.bool()
    metrics: dict[str, float] = {}
    low_bound = 1.0 / upper if lower is None else lower
    if valid.any() and rollout_is == "sequence":  # per-response statistics of the untruncated weight
        metrics["rollout_is_mean"] = ops.masked_mean(weights, mask).item()
        metrics["rollout_is_max"] = math.exp(min(log_w.max().item(), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(log_w.min().item())
        metrics["rollout_is_ratio_fraction_high"] = (log_w > math.log(upper)).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_w < math.log(low_bound)).float().mean().item()
    elif valid.any():
        metrics["rollout_is_mean"] = ops.masked_mean(weights, mask).item()
        metrics["rollout_is_max"] = weights[valid].max().item()
        metrics["rollout_is_min"] = weights[valid].min().item()
        metrics["rollout_is_ratio_fraction_high"] = ops.masked_mean((raw > upper).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = ops.masked_mean((raw < low_bound).float(), mask).item()
    if valid.any():
        clipped = weights.clamp(min=0.0, max=upper)
        normalized = clipped / (ops.masked_mean(clipped, mask) + 1e-8)
        metrics["rollout_is_eff_sample_size"] = 1.0 / ops.masked_mean(normalized.square(), mask).item()
        if lower is not None:
            metrics["rollout_is_oob_ratio"] = ops.masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = ops.masked_mean(weights, mask)
        else:
            per_seq = (weights * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            has = (mask.sum(-1) > 0).to(weights.dtype)
            mean = (per_seq * has).sum() / has.sum().clamp(min=1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with rejected tokens (or whole responses) removed, and masked-fraction metrics."""
    options = parse_rs(rollout_rs, rollout_rs_threshold)
    mask = response_mask.to(log_ratio.dtype)
    valid = mask.bool()
    lr = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    stats = {"k1": -lr, "k2": 0.5 * lr**2, "k3": torch.exp(lr) - 1.0 - lr}
    keep_all = torch.ones_like(mask)
    metrics: dict[str, float] = {}
    seq_valid = valid.any(dim=-1)
    for name, low, up in options:
        stat = stats[name[-2:]]
        if name.startswith("token"):
            values = stat
        elif name.startswith("seq_sum"):
            values = (stat * mask).sum(-1, keepdim=True)
        elif name.startswith("seq_mean"):
            values = ((stat * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8)).unsqueeze(-1)
        else:  # seq_max
            filled = stat.masked_fill(~valid, float("-inf")).max(dim=-1, keepdim=True).values
            values = torch.where(torch.isinf(filled), torch.zeros_like(filled), filled)
        if low is not None:  # k1: bounds on the log-ratio statistic, in log space (verl's convention)
            keep = (values >= math.log(low)) & (values <= math.log(up))
        else:
            keep = values <= up
        keep = keep.expand_as(mask).to(mask.dtype)
        keep_all = keep_all * keep
        metrics[f"rollout_rs_{name}_masked_fraction"] = ops.masked_mean(1 - keep, mask).item() if valid.any() else 0.0
        seq_rejected = ((keep < 0.5) & valid).any(dim=-1)
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (
            (seq_rejected & seq_valid).float().sum() / seq_valid.float().sum().clamp(min=1)
        ).item()
    metrics["rollout_rs_masked_fraction"] = ops.masked_mean(1 - keep_all, mask).item() if valid.any() else 0.0
    metrics["rollout_rs_seq_masked_fraction"] = (((keep_all < 0.5) & valid).any(dim=-1)).float().mean().item()
    return (response_mask * keep_all).to(response_mask.dtype), metrics


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Any = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Any = None,
) -> tuple[Optional[torch.Tensor], torch.Tensor, dict[str, float]]:
    """(IS weights or None, the response mask after rejection, metrics prefixed ``rollout_corr/``).

    verl returns the weights inside a DataProto; here it is the tensor. The
    weights are computed over the original response mask, as in verl.
    """
    check_token_tensors(old_log_prob=old_log_prob, rollout_log_prob=rollout_log_prob, response_mask=response_mask)
    log_ratio = (old_log_prob - rollout_log_prob).float()
    metrics: dict[str, float] = {}
    mask = response_mask
    if rollout_rs is not None:
        mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics |= rs_metrics
    weights = None
    if rollout_is is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics |= is_metrics
    fmask = response_mask.float()
    if fmask.sum() > 0:  # off-policy diagnostics, always reported
        metrics["kl"] = ops.masked_mean(-log_ratio, fmask).item()
        metrics["k3_kl"] = ops.masked_mean(torch.exp(log_ratio.clamp(-20, 20)) - 1 - log_ratio, fmask).item()
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def apply_rollout_correction(batch: Any, correction: Any) -> dict[str, float]:
    """Trainer stage: from ``old_log_probs`` and ``rollout_log_probs`` write
    ``batch["rollout_is_weights"]`` (when ``rollout_is`` is set) and the rejected ``response_mask``;
    returns the metrics. In bypass mode ``old_log_probs`` already are the rollout's."""
    corr = RolloutCorrection.from_config(correction)
    if corr.rollout_is is None and corr.rollout_rs is None:
        return {}
    batch.require("old_log_probs", "rollout_log_probs", "response_mask", where=KEY)
    weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
        batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"],
        corr.rollout_is, corr.rollout_is_threshold, corr.rollout_is_batch_normalize,
        corr.rollout_rs, corr.rollout_rs_threshold,
    )
    batch.batch["response_mask"] = mask
    if weights is not None:
        batch.batch["rollout_is_weights"] = weights
    return metrics


def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's bypass-mode loss: ``old_log_prob`` are the rollout's log-probs; the correction settings
    come from ``config.policy_loss.rollout_correction``. ppo_clip: the vanilla loss (its ratio is
    pi/pi_rollout; weights only reported); reinforce: -A * w * log pi with w = pi/pi_rollout (IS
    settings applied, detached)."""
    from megatron_rl.algos.loss_agg import agg_loss
    from megatron_rl.algos.policy_loss import compute_policy_loss_vanilla, global_batch_from_config

    policy_loss = getattr(config, "policy_loss", None) if config is not None else None
    corr_cfg = policy_loss.get("rollout_correction", None) if hasattr(policy_loss, "get") else None
    if corr_cfg is None:
        raise ValueError("bypass mode needs config.policy_loss.rollout_correction (verl's layout)")
    corr = RolloutCorrection.from_config(corr_cfg)
    with torch.no_grad():
        weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
            log_prob.detach(), old_log_prob, response_mask, corr.rollout_is, corr.rollout_is_threshold,
            corr.rollout_is_batch_normalize, corr.rollout_rs, corr.rollout_rs_threshold,
        )
    if corr.loss_type == "ppo_clip":
        loss, pg_metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode, config)
        return loss, {**pg_metrics, **metrics}
    w = weights if weights is not None else torch.exp(torch.clamp(log_prob - old_log_prob, -20, 20)).detach()
    per_token = -advantages * w * log_prob
    gb = global_batch_from_config(config)
    loss = agg_loss(per_token, mask, loss_agg_mode, **gb.agg_kwargs())
    ppo_kl = ops.masked_mean((old_log_prob - log_prob).detach(), mask.float()).item()
    return loss, {"actor/ppo_kl": ppo_kl, **metrics}
