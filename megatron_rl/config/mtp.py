"""``actor_rollout_ref.model.mtp`` (verl's multi-token-prediction keys) checked before launch, on their own (validation;
against the checkpoint's config.json the planner's model facts refuse ``enable`` without MTP layers:
plan/model_facts.py). The workers build what passes (models/mtp.py); docs/models.md "Multi-token prediction"."""

from __future__ import annotations

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.lora import lora_enabled
from megatron_rl.config.schema import PPOTrainerConfig

PREFIX = "actor_rollout_ref.model.mtp"


def check_mtp_settings(cfg: PPOTrainerConfig) -> None:
    """The keys on their own: what needs ``enable``, what is not built, the loss weight."""
    mtp = cfg.actor_rollout_ref.model.mtp
    if cfg.critic.model.mtp.enable:
        raise ConfigError("critic.model.mtp.enable=true: a critic builds no multi-token-prediction layers (its value "
                          f"head replaces the output layer they predict through); the actor's are {PREFIX}")
    for key in ("enable_train", "enable_rollout", "detach_encoder"):
        if getattr(mtp, key) and not mtp.enable:
            raise ConfigError(f"{PREFIX}.{key}=true needs {PREFIX}.enable=true (the MTP layers built and loaded)")
    if mtp.enable_rollout:
        raise ConfigError(
            f"{PREFIX}.enable_rollout=true: speculative decoding with the MTP layers is not built here (the engines' "
            "drafter would need the MTP weights at every weight sync, which only the trainer's HF export carries). "
            f"Set it false: the rollout decodes without drafting, and {PREFIX}.enable / enable_train still load, "
            "train and export the MTP layers")
    factor = mtp.mtp_loss_scaling_factor
    if not factor >= 0:
        raise ConfigError(f"{PREFIX}.mtp_loss_scaling_factor={factor} must be >= 0 (the MTP loss's weight)")
    if mtp.enable and lora_enabled(cfg.actor_rollout_ref.model.lora):
        raise ConfigError(f"{PREFIX}.enable=true with actor_rollout_ref.model.lora.rank="
                          f"{cfg.actor_rollout_ref.model.lora.rank}: LoRA with the MTP layers is not built here; set "
                          "one of them off")
    if mtp.enable_train and cfg.actor_rollout_ref.actor.megatron.context_parallel_size > 1:
        raise ConfigError(
            f"{PREFIX}.enable_train=true with actor_rollout_ref.actor.megatron.context_parallel_size="
            f"{cfg.actor_rollout_ref.actor.megatron.context_parallel_size}: the MTP loss under context parallelism "
            "is not built here (its targets cross the CP shards); set context_parallel_size=1 or enable_train=false")
    if mtp.enable_train and cfg.actor_rollout_ref.actor.megatron.share_prompts:
        raise ConfigError(
            f"{PREFIX}.enable_train=true with actor_rollout_ref.actor.megatron.share_prompts=true: the MTP loss "
            "over shared-prompt rows is not built here; set share_prompts=false or enable_train=false")

