"""verl.trainer.config on megatron-rl (only ``algorithm.RolloutCorrectionConfig``)."""

from megatron_rl.compat.verl.trainer.config.algorithm import RolloutCorrectionConfig

__all__ = ["RolloutCorrectionConfig"]
