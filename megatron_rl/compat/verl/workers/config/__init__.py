"""verl.workers.config on megatron-rl (the actor's loss settings)."""

from megatron_rl.compat.verl.workers.config.actor import ActorConfig, PolicyLossConfig

__all__ = ["ActorConfig", "PolicyLossConfig"]
