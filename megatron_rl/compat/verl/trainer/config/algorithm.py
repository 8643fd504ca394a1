"""``verl.trainer.config.algorithm.RolloutCorrectionConfig``: megatron-rl's
``algorithm.rollout_correction`` config (megatron_rl.config.schema) with verl's class default
(``rollout_is="sequence"``; megatron-rl's YAML default, like verl's, is null), verl's mapping
interface and verl's named presets (docs/algorithms.md, rollout correction)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Self

from megatron_rl.compat.verl.base_config import BaseConfig
from megatron_rl.config import schema

__all__ = ["RolloutCorrectionConfig"]

_GEO_RS = "0.999_1.001"  # seq_mean_k1 within +-0.1% of ratio 1
_K3_RS = 0.01


@dataclass
class RolloutCorrectionConfig(BaseConfig, schema.RolloutCorrectionConfig):
    rollout_is: Optional[str] = "sequence"

    # -- decoupled mode (three policies: rollout, old, current) --
    @classmethod
    def decoupled_token_is(cls, threshold: float = 2.0) -> Self:
        return cls(rollout_is="token", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_seq_is(cls, threshold: float = 2.0) -> Self:
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None)

    @classmethod
    def decoupled_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> Self:
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}", rollout_rs=None)

    @classmethod
    def decoupled_seq_is_rs(cls, is_threshold: float = 2.0, rs_threshold: Any = "0.5_2.0") -> Self:
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_sum_k1",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs(cls, rs_threshold: Any = _GEO_RS) -> Self:
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: Any = _GEO_RS) -> Self:
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: Any = _GEO_RS) -> Self:
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs(cls, rs_threshold: float = _K3_RS) -> Self:
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: float = _K3_RS) -> Self:
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    @classmethod
    def decoupled_k3_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: float = _K3_RS) -> Self:
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=rs_threshold)

    # -- bypass mode (old_log_prob := rollout_log_prob; loss_type picks PPO-clip or REINFORCE) --
    @classmethod
    def bypass_ppo_clip(cls) -> Self:
        return cls(rollout_is=None, rollout_rs=None, bypass_mode=True, loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_geo_rs(cls, rs_threshold: Any = _GEO_RS) -> Self:
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def bypass_ppo_clip_k3_rs(cls, rs_threshold: float = _K3_RS) -> Self:
        return cls(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="ppo_clip")

    @classmethod
    def bypass_pg_is(cls, threshold: float = 2.0) -> Self:
        return cls(rollout_is="sequence", rollout_is_threshold=threshold, rollout_rs=None, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def bypass_pg_token_icepop(cls, threshold: float = 5.0, threshold_lower: float = 0.5) -> Self:
        return cls(rollout_is="token", rollout_is_threshold=f"{threshold_lower}_{threshold}", rollout_rs=None,
                   bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs(cls, rs_threshold: Any = _GEO_RS) -> Self:
        return cls(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold=rs_threshold, bypass_mode=True,
                   loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_seq_tis(cls, is_threshold: float = 2.0, rs_threshold: Any = _GEO_RS) -> Self:
        return cls(rollout_is="sequence", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def bypass_pg_geo_rs_token_tis(cls, is_threshold: float = 2.0, rs_threshold: Any = _GEO_RS) -> Self:
        return cls(rollout_is="token", rollout_is_threshold=is_threshold, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=rs_threshold, bypass_mode=True, loss_type="reinforce")

    @classmethod
    def disabled(cls) -> Self:
        return cls(rollout_is=None, rollout_rs=None)
