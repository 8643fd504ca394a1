"""Compose a config from configs/ the way `python -m megatron_rl.train` does, for tests and tools."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_rl.config.checks import describe_choice_error, verl_recipe_hints
from megatron_rl.config.errors import ConfigError
from megatron_rl.config.lora import fold_lora_aliases
from megatron_rl.config.schema import PPOTrainerConfig, register_configs

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def load_config(config_name: str = "ppo_trainer", overrides: Sequence[str] = (),
                config_dir: str | Path = CONFIG_DIR) -> DictConfig:
    """Compose ``config_name`` with Hydra-style ``overrides`` (``key=value``, ``+experiment=...``)."""
    register_configs()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
            cfg = compose(config_name=config_name, overrides=list(overrides))
        OmegaConf.resolve(cfg)
        fold_lora_aliases(cfg)  # verl's flat LoRA keys (model.lora_rank, ...) into model.lora
    except (ConfigCompositionException, OmegaConfBaseException) as err:
        # Hydra wraps the useful part (the bad key) in a cause; surface it.
        cause = err.__cause__ or err
        choice = describe_choice_error(str(getattr(cause, "msg", cause)), getattr(cause, "full_key", ""),
                                       getattr(cause, "object_type", None), getattr(cause, "key", None))
        if choice is not None:
            raise ConfigError(choice) from err
        recipe = verl_recipe_hints(_override_keys(overrides))
        if recipe:
            raise ConfigError("; ".join(recipe) + f" (composing {config_name!r} failed: {cause})") from err
        raise ConfigError(f"cannot compose config {config_name!r} with overrides {list(overrides)}: {cause}") from err
    return cfg


def typed_config(cfg: DictConfig | PPOTrainerConfig) -> PPOTrainerConfig:
    """The config as its dataclass tree, interpolations resolved: what the workers receive (under Ray pickled as
    an init argument, under torchrun as is). Attribute access reads as on the DictConfig; choice fields stay
    their StrEnums, the free-form fields (``override_config``, ``plan.architecture``, ...) are plain dicts. A
    config not composed on the schema (built by hand) is merged onto it first, so it is checked the same."""
    if isinstance(cfg, PPOTrainerConfig):
        return cfg
    if OmegaConf.get_type(cfg) is not PPOTrainerConfig:
        cfg = OmegaConf.merge(OmegaConf.structured(PPOTrainerConfig), cfg)
    fold_lora_aliases(cfg)  # a no-op after validate(); the workers read model.lora, never the flat keys
    return OmegaConf.to_object(cfg)


def _override_keys(overrides: Sequence[str]) -> list[str]:
    """``key`` of each ``key=value`` / ``+key=value`` / ``~key`` override (a group's, e.g. ``experiment``, too:
    no recipe key is named like one)."""
    return [o.lstrip("+~").split("=", 1)[0] for o in overrides if "=" in o or o.startswith("~")]
