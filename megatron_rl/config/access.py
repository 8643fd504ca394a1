"""Reading a config value the same way from the composed DictConfig (what validation and preflight see, where a
mandatory path may still be unset) and from its typed tree (what the run and the workers hold)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, OmegaConf

if TYPE_CHECKING:  # the schema imports Hydra; reading a value needs only OmegaConf (models/ and controller/ use this)
    from megatron_rl.config.schema import MegatronParallelConfig, PPOTrainerConfig


def is_unset(section: Any, name: str) -> bool:
    """``section.name`` is the schema's mandatory ``???`` (a model path not given yet)."""
    if OmegaConf.is_config(section):
        return OmegaConf.is_missing(section, name)
    return getattr(section, name) == MISSING


def plain(value: Any) -> Any:
    """A free-form field (``override_config``, engine kwargs) as plain Python: a DictConfig or ListConfig resolved
    into dicts and lists; anything else as it is."""
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def megatron_section(cfg: PPOTrainerConfig, role: str) -> MegatronParallelConfig:
    """The ``megatron`` block of a Megatron role, by the key it is set under (``actor_rollout_ref.actor``,
    ``actor_rollout_ref.ref``, ``critic``, ``reward_model``)."""
    sections = {"actor_rollout_ref.actor": lambda: cfg.actor_rollout_ref.actor.megatron,
                "actor_rollout_ref.ref": lambda: cfg.actor_rollout_ref.ref.megatron,
                "critic": lambda: cfg.critic.megatron,
                "reward_model": lambda: cfg.reward_model.megatron}
    if role not in sections:
        raise KeyError(f"{role!r} is not a Megatron role; the roles: {sorted(sections)}")
    return sections[role]()
