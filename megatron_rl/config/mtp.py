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
        _check_rollout_log_probs_unused(cfg)
    if mtp.enable_rollout and (mtp.method != "mtp" or mtp.num_speculative_tokens < 1):
        raise ConfigError(f"{PREFIX}.method={mtp.method!r} / num_speculative_tokens={mtp.num_speculative_tokens}: "
                          "drafting with the model's MTP layers is vLLM's method 'mtp' with >= 1 token")
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



def _check_rollout_log_probs_unused(cfg: PPOTrainerConfig) -> None:
    """Drafting while it samples, vLLM 0.32 returns no true per-token log-probs (rollout/vllm/engine.py drops them):
    what reads the rollout's log-probs is refused with enable_rollout."""
    corr = cfg.algorithm.rollout_correction
    users = {
        "algorithm.rollout_correction.bypass_mode": corr.bypass_mode,
        "algorithm.rollout_correction.rollout_is": corr.rollout_is is not None,
        "algorithm.rollout_correction.rollout_rs": corr.rollout_rs is not None,
        "actor_rollout_ref.actor.tis_imp_ratio_cap": cfg.actor_rollout_ref.actor.tis_imp_ratio_cap is not None,
        "actor_rollout_ref.rollout.multi_turn.enable": cfg.actor_rollout_ref.rollout.multi_turn.enable,
    }
    for key, used in users.items():
        if used:
            raise ConfigError(
                f"{PREFIX}.enable_rollout=true with {key} set: it reads the rollout engine's per-token log-probs, "
                "which vLLM 0.32 does not return true while it drafts and samples (0 for an accepted draft, "
                "log(1 / vocab) or NaN after it); unset one of them (the update uses the trainer's own old log-probs)")
