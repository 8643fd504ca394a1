"""``verl.trainer.ppo.rollout_corr_helper`` on ``megatron_rl.algos.rollout_corr``.

The one difference from the megatron-rl functions is verl's return type: the IS weights come back
inside a DataProto (``.batch["rollout_is_weights"]``), and ``compute_rollout_correction_and_add_to_batch``
returns ``(batch, metrics)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megatron_rl.algos import rollout_corr
from megatron_rl.algos.rollout_corr import (
    SAFETY_BOUND,
    compute_is_metrics,
    compute_offpolicy_metrics,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from megatron_rl.compat.verl.protocol import DataProto

SUPPORTED_ROLLOUT_RS_OPTIONS: set[str] = set(rollout_corr.RS_OPTIONS)
TOKEN_LEVEL_ROLLOUT_RS_OPTIONS: set[str] = {o for o in rollout_corr.RS_OPTIONS if o.startswith("token_")}

__all__ = [
    "SAFETY_BOUND",
    "SUPPORTED_ROLLOUT_RS_OPTIONS",
    "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS",
    "compute_is_metrics",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_add_to_batch",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
]


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: Optional[str] = None,
    rollout_is_threshold: Any = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: Optional[str] = None,
    rollout_rs_threshold: Any = None,
) -> tuple[Optional[DataProto], torch.Tensor, dict[str, float]]:
    """(DataProto holding ``rollout_is_weights`` or None, the rejected response mask, metrics)."""
    weights, mask, metrics = rollout_corr.compute_rollout_correction_and_rejection_mask(
        old_log_prob, rollout_log_prob, response_mask, rollout_is, rollout_is_threshold,
        rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold,
    )
    proto = None if weights is None else DataProto.from_dict(tensors={"rollout_is_weights": weights})
    return proto, mask, metrics


def compute_rollout_correction_and_add_to_batch(batch: DataProto, rollout_corr_config: Any) -> tuple[DataProto, dict]:
    """Writes the rejected ``response_mask`` and (when ``rollout_is`` is set) ``rollout_is_weights``
    into ``batch``; returns (batch, metrics). Reads verl's five keys from the config."""
    keys = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")
    defaults = rollout_corr.RolloutCorrection()
    settings = {k: rollout_corr_config.get(k, getattr(defaults, k)) for k in keys}
    metrics = rollout_corr.apply_rollout_correction(batch, rollout_corr.RolloutCorrection(**settings))
    return batch, metrics
