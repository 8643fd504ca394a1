"""``verl.workers.config.actor``: verl's ``ActorConfig`` / ``PolicyLossConfig`` with the keys the
policy losses read, so verl code can build a config and pass it to ``core_algos``' losses.

The losses (megatron_rl.algos.policy_loss) read these through ``PolicyLossConfig.from_actor_config``:
clip ratios, ``tau_pos``/``tau_neg`` and ``global_batch_info`` from the actor, the loss-specific keys
(``dro_beta``, ``clip_cov_*``, ``kl_cov_ratio``, ``ppo_kl_coef``) from ``policy_loss``. megatron-rl's
own trainer config is megatron_rl.config.schema.ActorConfig (flat ``policy_loss`` name); the
engine-side keys verl's class also carries (optim, checkpoint, fsdp/megatron engine) are not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from megatron_rl.compat.verl.base_config import BaseConfig
from megatron_rl.compat.verl.trainer.config.algorithm import RolloutCorrectionConfig

__all__ = ["ActorConfig", "PolicyLossConfig"]

LOSS_AGG_MODES = (
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
)


@dataclass
class PolicyLossConfig(BaseConfig):
    """``actor_rollout_ref.actor.policy_loss``: the registered loss name and its parameters."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None  # required (> 0) by loss_mode=dro, checked when the loss runs
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.loss_mode, str) or not self.loss_mode:
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.loss_mode must be a loss name, got {self.loss_mode!r}"
            )


@dataclass
class ActorConfig(BaseConfig):
    """``actor_rollout_ref.actor``: ``strategy`` and ``rollout_n`` must be given (as in verl)."""

    # the batch sizes verl's trainer rescales after construction
    _mutable_fields: ClassVar[set[str]] = {
        "ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_micro_batch_size_per_gpu",
    }

    strategy: Optional[str] = None
    rollout_n: Optional[int] = None
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: Optional[int] = None  # deprecated in verl: use ppo_micro_batch_size_per_gpu
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[int] = None
    entropy_coeff: float = 0.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    # the mini-batch normalisers verl's actor fills per step: dp_size, batch_num_tokens, global_batch_size
    global_batch_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("strategy", "rollout_n"):
            if getattr(self, key) is None:
                raise ValueError(f"actor_rollout_ref.actor.{key} must be set")
        if not self.use_dynamic_bsz:
            mbs, per_gpu = self.ppo_micro_batch_size, self.ppo_micro_batch_size_per_gpu
            if mbs is not None and per_gpu is not None:
                raise ValueError(
                    "actor_rollout_ref.actor: set ppo_micro_batch_size_per_gpu, not both it and the deprecated "
                    "ppo_micro_batch_size"
                )
            if mbs is None and per_gpu is None:
                raise ValueError(
                    "actor_rollout_ref.actor: set ppo_micro_batch_size_per_gpu (or the deprecated "
                    "ppo_micro_batch_size) when use_dynamic_bsz is false"
                )
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(
                f"actor_rollout_ref.actor.loss_agg_mode: {self.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}"
            )
        if isinstance(self.policy_loss, dict):  # verl configs arrive as nested dicts from YAML too
            object.__setattr__(self, "policy_loss", PolicyLossConfig(**self.policy_loss))
