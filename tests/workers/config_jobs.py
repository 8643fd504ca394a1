"""The job of test_worker_config.py: the torchrun path of the runner builds its worker groups (no model is loaded)."""
from __future__ import annotations

from typing import Any


def torchrun_groups_job(overrides: list[str]) -> dict[str, Any]:
    from megatron_rl.config import PPOTrainerConfig, load_config, typed_config
    from megatron_rl.plan.validate import validate
    from megatron_rl.trainer import runner

    cfg = load_config(overrides=overrides)
    sizes = validate(cfg)
    # as run_training does: the config typed once, then the groups hand that tree to every worker
    actor_rollout, critic, reward_model, close = runner._torchrun_groups(typed_config(cfg), sizes)
    try:
        actor_cfg, critic_cfg = actor_rollout.worker.config, critic.worker.config
        return {
            "actor": type(actor_cfg).__name__, "critic": type(critic_cfg).__name__,
            "typed": isinstance(actor_cfg, PPOTrainerConfig) and isinstance(critic_cfg, PPOTrainerConfig),
            "equal": actor_cfg == typed_config(cfg),
            "kl_loss_type": type(actor_cfg.actor_rollout_ref.actor.kl_loss_type).__name__,
            "params_dtype": str(critic_cfg.critic.megatron.params_dtype),
            "critic_path": critic_cfg.critic.model.path,  # an interpolation of the actor's path, resolved
            "reward_model": reward_model,
        }
    finally:
        close()
