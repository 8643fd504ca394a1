"""Megatron roles: actor, reference, critic on a MegatronEngine (docs/workers.md).

    engine = MegatronEngine(model_dir, actor_cfg.megatron, actor_cfg.optim, name="actor_rollout_ref.actor")
    actor = ActorRole(engine, actor_cfg, rollout_n=n)
    ref = ReferenceRole(MegatronEngine(model_dir, ref_cfg.megatron, name="actor_rollout_ref.ref"), ref_cfg)
    critic = CriticRole(MegatronEngine(critic_dir, critic_cfg.megatron, critic_cfg.optim, value_head=True,
                                       value_head_init=critic_cfg.value_head_init, name="critic"),
                        critic_cfg, rollout_n=n, ppo_mini_batch_size=actor_cfg.ppo_mini_batch_size,
                        ppo_epochs=actor_cfg.ppo_epochs)

Names resolve lazily so that the Megatron-free modules (batch checks, micro-batching, packing) load
without importing Megatron-Core.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "ActorRole": "actor",
    "CriticRole": "critic",
    "ReferenceRole": "reference",
    "MegatronEngine": "engine",
    "save_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "read_checkpoint_metadata": "checkpoint",
    "MicroBatchSpec": "micro_batches",
    "check_batch": "batch_checks",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_rl.workers' has no attribute {name!r}")
    return getattr(import_module(f"megatron_rl.workers.{_EXPORTS[name]}"), name)
