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
from megatron_rl.algos.config_view import ActorConfigLike, RolloutCorrectionConfigLike, by_attribute
from megatron_rl.algos.loss_agg import agg_loss
from megatron_rl.algos.policy_loss import compute_policy_loss_vanilla, register_policy_loss
from megatron_rl.algos.policy_loss_config import PolicyLossConfig, global_batch_from_config
from megatron_rl.protocol import DataProto

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


class ThresholdTypeError(TypeError, ValueError):
    """A threshold of the wrong type: verl raises TypeError, megatron-rl's config checks ValueError."""


def parse_is_threshold(spec: Any) -> tuple[float, Optional[float]]:
    """(upper, lower): a number -> (x, None) = truncation; "lower_upper" -> masking outside [lower, upper]."""
    if isinstance(spec, bool):  # bool is an int in Python; True must not mean a threshold of 1
        raise ThresholdTypeError(f"{KEY}.rollout_is_threshold must be a number or 'lower_upper', not a boolean "
                                 f"(got {spec!r})")
    if not isinstance(spec, (int, float, str)):
        raise ThresholdTypeError(f"{KEY}.rollout_is_threshold must be a number or 'lower_upper', got {spec!r}")
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
    def from_config(cls, cfg: RolloutCorrection | RolloutCorrectionConfigLike | None) -> RolloutCorrection:
        if cfg is None:
            return cls()
        if isinstance(cfg, RolloutCorrection):
            return cfg
        known = cls.__dataclass_fields__
        keys = list(cfg.keys()) if hasattr(cfg, "keys") else list(known)
        unknown = [k for k in keys if k not in known and not str(k).startswith("_")]
        if unknown:
            raise ValueError(f"{KEY} has unknown keys {unknown}; known: {list(known)}")
        cfg = by_attribute(cfg)
        return cls(**{k: getattr(cfg, k, f.default) for k, f in known.items()})

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
    metrics = compute_is_metrics(weights, raw, log_w, response_mask, rollout_is, upper, lower)
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


def _require_valid(response_mask: torch.Tensor) -> None:
    if not bool(response_mask.bool().any()):
        raise ValueError("response_mask has no valid token: rollout-correction statistics need at least one")


def compute_is_metrics(
    rollout_is_weights: torch.Tensor,
    raw_rollout_is_weights: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    rollout_is_threshold: float,
    rollout_is_threshold_lower: Optional[float] = None,
) -> dict[str, float]:
    """Statistics of the applied weights and of the raw ones (verl's names and numbers).

    ``log_ratio_for_metrics`` is the per-token log-ratio (token level) or the per-response sum
    [B, 1] (sequence level): the sequence-level max/min and high/low fractions are taken in log
    space, so a weight beyond exp(20) is still counted. The seq_* metrics use each response's
    mean weight; their high/low fractions use the raw weights (a truncated mean never exceeds
    the threshold)."""
    _require_valid(response_mask)
    mask = response_mask.to(rollout_is_weights.dtype)
    valid = mask.bool()
    upper = float(rollout_is_threshold)
    low_bound = 1.0 / upper if rollout_is_threshold_lower is None else float(rollout_is_threshold_lower)
    metrics: dict[str, float] = {"rollout_is_mean": ops.masked_mean(rollout_is_weights, mask).item()}
    if rollout_is == "sequence":
        metrics["rollout_is_max"] = math.exp(min(log_ratio_for_metrics.max().item(), SAFETY_BOUND))
        metrics["rollout_is_min"] = math.exp(log_ratio_for_metrics.min().item())
        metrics["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > math.log(upper)).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < math.log(low_bound)).float().mean().item()
    else:
        metrics["rollout_is_max"] = rollout_is_weights[valid].max().item()
        metrics["rollout_is_min"] = rollout_is_weights[valid].min().item()
        metrics["rollout_is_ratio_fraction_high"] = ops.masked_mean((raw_rollout_is_weights > upper).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = ops.masked_mean(
            (raw_rollout_is_weights < low_bound).float(), mask
        ).item()
    clipped = rollout_is_weights.clamp(min=0.0, max=upper)
    clipped_mean = ops.masked_mean(clipped, mask)
    if mask.sum() > 1:
        variance = ops.masked_mean(clipped.square(), mask) - clipped_mean.square()
        metrics["rollout_is_std"] = variance.clamp(min=0.0).sqrt().item()
    else:
        metrics["rollout_is_std"] = 0.0
    normalized = clipped / (clipped_mean + 1e-8)
    metrics["rollout_is_eff_sample_size"] = 1.0 / ops.masked_mean(normalized.square(), mask).item()
    if rollout_is_weights.dim() > 1:
        seq_mean = ops.masked_mean(rollout_is_weights, mask, dim=-1)
        metrics["rollout_is_seq_mean"] = seq_mean.mean().item()
        metrics["rollout_is_seq_std"] = seq_mean.std().item() if seq_mean.numel() > 1 else 0.0
        metrics["rollout_is_seq_max"] = seq_mean.max().item()
        metrics["rollout_is_seq_min"] = seq_mean.min().item()
        metrics["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
        raw_seq_mean = ops.masked_mean(raw_rollout_is_weights, mask, dim=-1)
        metrics["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean().item()
        metrics["rollout_is_seq_fraction_low"] = (raw_seq_mean < low_bound).float().mean().item()
    return metrics


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    response_mask: torch.Tensor,
) -> dict[str, float]:
    """How far the trainer's policy is from the rollout's (verl's names, unprefixed), always reported.

    training_ppl / rollout_ppl: batch mean of each response's exp(-mean log-prob); *_log_ppl the
    same without exp. kl = E[log pi_rollout - log pi_old]; k3_kl = E[r - 1 - log r], r = pi_old/pi_rollout.
    log_ppl_diff (mean, abs mean, max, min over responses) = mean log pi_rollout - mean log pi_old per
    response; ppl_ratio = mean exp(log_ppl_diff). chi2_token = E_token[r^2] - 1; chi2_seq =
    E_seq[(prod_t r_t)^2] - 1 (log-ratios clamped at +-20). Without rollout log-probs only the
    training perplexity is reported."""
    _require_valid(response_mask)
    mask = response_mask.to(old_log_prob.dtype)
    seq_train = ops.masked_mean(old_log_prob, mask, dim=-1)
    metrics = {
        "training_ppl": torch.exp(-seq_train).mean().item(),
        "training_log_ppl": (-seq_train).mean().item(),
    }
    if rollout_log_prob is None:
        return metrics
    log_ratio = old_log_prob - rollout_log_prob
    seq_rollout = ops.masked_mean(rollout_log_prob, mask, dim=-1)
    log_ppl_diff = seq_rollout - seq_train
    clamped = torch.clamp(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    seq_log_ratio = torch.clamp((log_ratio * mask).sum(-1), -SAFETY_BOUND, SAFETY_BOUND)
    metrics |= {
        "kl": ops.masked_mean(-log_ratio, mask).item(),
        "k3_kl": ops.masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
        "rollout_ppl": torch.exp(-seq_rollout).mean().item(),
        "rollout_log_ppl": (-seq_rollout).mean().item(),
        "log_ppl_diff": log_ppl_diff.mean().item(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean().item(),
        "log_ppl_diff_max": log_ppl_diff.max().item(),
        "log_ppl_diff_min": log_ppl_diff.min().item(),
        "ppl_ratio": torch.exp(log_ppl_diff).mean().item(),
        "chi2_token": (ops.masked_mean(torch.exp(clamped).square(), mask) - 1.0).item(),
        "chi2_seq": (torch.exp(2.0 * seq_log_ratio).mean() - 1.0).item(),
    }
    return metrics


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
        bounds = (math.log(low), math.log(up)) if low is not None else (None, up)
        if low is not None:  # k1: bounds on the log-ratio statistic, in log space (verl's convention)
            keep = (values >= bounds[0]) & (values <= bounds[1])
        else:
            keep = values <= up
        if valid.any():
            level_values = None if name.startswith("token") else values.squeeze(-1)
            metrics |= _rs_statistics(name, values.expand_as(mask), level_values, mask, *bounds)
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


def _rs_statistics(
    name: str, per_token: torch.Tensor, per_sequence: Optional[torch.Tensor], mask: torch.Tensor,
    lower: Optional[float], upper: float,
) -> dict[str, float]:
    """One rejection option's statistic: mean/max/min/std, the shares beyond the bounds, and the same
    over responses (``seq_*``). Sequence-level options count responses; token-level ones tokens.
    ``lower`` is None for the one-sided k2/k3 options (their low fraction is 0)."""
    prefix = f"rollout_rs_{name}"
    valid = mask.bool()
    seq_valid = valid.any(dim=-1)
    seq_values = (per_sequence if per_sequence is not None else ops.masked_mean(per_token, mask, dim=-1))[seq_valid]
    low = 0.0 if lower is None else lower
    out = {f"{prefix}_mean": ops.masked_mean(per_token, mask).item()}
    if per_sequence is not None:
        out[f"{prefix}_max"], out[f"{prefix}_min"] = seq_values.max().item(), seq_values.min().item()
        out[f"{prefix}_fraction_high"] = (seq_values > upper).float().mean().item()
        out[f"{prefix}_fraction_low"] = (seq_values < low).float().mean().item() if lower is not None else 0.0
    else:
        out[f"{prefix}_max"], out[f"{prefix}_min"] = per_token[valid].max().item(), per_token[valid].min().item()
        out[f"{prefix}_fraction_high"] = ops.masked_mean((per_token > upper).float(), mask).item()
        out[f"{prefix}_fraction_low"] = (
            ops.masked_mean((per_token < low).float(), mask).item() if lower is not None else 0.0
        )
    if mask.sum() > 1:
        clamped = per_token.clamp(min=low, max=upper)
        variance = ops.masked_mean(clamped.square(), mask) - ops.masked_mean(clamped, mask).square()
        out[f"{prefix}_std"] = variance.clamp(min=0.0).sqrt().item()
    else:
        out[f"{prefix}_std"] = 0.0
    out[f"{prefix}_seq_mean"] = seq_values.mean().item()
    out[f"{prefix}_seq_std"] = seq_values.std().item() if seq_values.numel() > 1 else 0.0
    out[f"{prefix}_seq_max"] = seq_values.max().item()
    out[f"{prefix}_seq_min"] = seq_values.min().item()
    out[f"{prefix}_seq_max_deviation"] = seq_values.abs().max().item()  # the ideal divergence is 0
    out[f"{prefix}_seq_fraction_high"] = (seq_values > upper).float().mean().item()
    if lower is not None:
        out[f"{prefix}_seq_fraction_low"] = (seq_values < low).float().mean().item()
    return out


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
    metrics |= compute_offpolicy_metrics(old_log_prob.float(), rollout_log_prob.float(), response_mask)
    return weights, mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def apply_rollout_correction(
    batch: DataProto, correction: RolloutCorrection | RolloutCorrectionConfigLike | None
) -> dict[str, float]:
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


def compute_policy_loss_reinforce(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-sum",
    config: PolicyLossConfig | ActorConfigLike | None = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain policy gradient (no ratio, no clip): per token -A * log pi, times ``rollout_is_weights``
    (detached) when given; aggregated with the config's ``global_batch_info``. ``actor/ppo_kl`` is
    the masked mean of rollout_log_prob - log_prob (verl's REINFORCE loss, its default aggregation)."""
    check_token_tensors(rollout_log_prob=rollout_log_prob, log_prob=log_prob, advantages=advantages,
                        response_mask=response_mask)
    per_token = -advantages * log_prob
    if rollout_is_weights is not None:
        check_token_tensors(log_prob=log_prob, rollout_is_weights=rollout_is_weights)
        per_token = per_token * rollout_is_weights.detach()
    loss = agg_loss(per_token, response_mask, loss_agg_mode, **global_batch_from_config(config).agg_kwargs())
    ppo_kl = ops.masked_mean((rollout_log_prob - log_prob).detach(), response_mask.float()).item()
    return loss, {"actor/ppo_kl": ppo_kl}


@register_policy_loss("bypass_mode")
def compute_policy_loss_bypass_mode(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: ActorConfigLike | None = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's bypass-mode loss: ``old_log_prob`` are the rollout's log-probs; the correction settings
    come from ``config.policy_loss.rollout_correction``. The IS weights (pi/pi_rollout, with the
    configured level and threshold) and the rejection mask are computed here from ``log_prob``
    (``rollout_is_weights`` is ignored, as in verl).

    ppo_clip: the vanilla loss on the rejection mask; its ratio is already pi/pi_rollout, so the weights
    are only reported (applying them would count the correction twice). reinforce:
    ``compute_policy_loss_reinforce`` with the weights (none when ``rollout_is`` is null)."""
    policy_loss = getattr(config, "policy_loss", None)
    corr_cfg = getattr(by_attribute(policy_loss), "rollout_correction", None)
    if corr_cfg is None:
        raise ValueError(
            "bypass mode needs config.policy_loss.rollout_correction (verl's layout: the actor config's "
            "policy_loss section carries algorithm.rollout_correction)"
        )
    corr = RolloutCorrection.from_config(corr_cfg)
    with torch.no_grad():
        weights, mask, metrics = compute_rollout_correction_and_rejection_mask(
            log_prob.detach(), old_log_prob, response_mask, corr.rollout_is, corr.rollout_is_threshold,
            corr.rollout_is_batch_normalize, corr.rollout_rs, corr.rollout_rs_threshold,
        )
    if corr.loss_type == "ppo_clip":
        loss, pg_metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, mask, loss_agg_mode, config)
    else:
        loss, pg_metrics = compute_policy_loss_reinforce(
            old_log_prob, log_prob, advantages, mask, loss_agg_mode, config, weights
        )
    return loss, {**pg_metrics, **metrics}
