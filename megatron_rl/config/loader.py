"""Compose a config from configs/ the way `python -m megatron_rl.train` does, for tests and tools."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationToMissingValueError, MissingMandatoryValue, OmegaConfBaseException

from megatron_rl.config.checks import (
    CheckError,
    check_choices,
    check_known_keys,
    check_verl_values,
    describe_choice_error,
    verl_recipe_hints,
)
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
    """The config as its dataclass tree, interpolations resolved: what validation, the planner and the run read,
    and what the workers receive (under Ray pickled as an init argument, under torchrun as is). Attribute access
    reads as on the DictConfig; choice fields stay their StrEnums, the free-form fields (``override_config``,
    ``plan.architecture``, ...) are plain dicts, and a mandatory value not given yet (``???``: a model path, the
    data files, which validation and the planner do without) stays ``MISSING`` (``access.is_unset``). A config not
    composed on the schema (built by hand) is merged onto it first, so it is checked the same."""
    if isinstance(cfg, PPOTrainerConfig):
        return cfg
    if OmegaConf.get_type(cfg) is not PPOTrainerConfig:
        cfg = OmegaConf.merge(OmegaConf.structured(PPOTrainerConfig), cfg)
    fold_lora_aliases(cfg)  # the workers read model.lora, never the flat keys
    return _to_object(cfg)


def checked_typed_config(cfg: DictConfig | PPOTrainerConfig) -> PPOTrainerConfig:
    """``typed_config`` where validation, the preflight or the planner is entered, once: a DictConfig first meets
    the checks that read it by its keys' strings (config/checks.py: every key known to the schema, the closed
    choices, verl's values), each refusal a ConfigError. A typed tree is returned as it is (it was checked when it
    was converted)."""
    if isinstance(cfg, PPOTrainerConfig):
        return cfg
    try:
        check_known_keys(cfg)
        check_choices(cfg)
        check_verl_values(cfg)
    except CheckError as err:
        raise ConfigError(str(err)) from None
    try:
        return typed_config(cfg)
    except OmegaConfBaseException as err:  # a config built by hand with a value its schema field cannot hold
        raise ConfigError(f"the config does not fit its schema (config/schema.py): {err}") from None


_UNSET = (MissingMandatoryValue, InterpolationToMissingValueError)  # a ``???`` value, or one taken from a ``???``


def _to_object(node: DictConfig) -> Any:
    """``OmegaConf.to_object`` of a structured node, keeping a ``???`` value (or one interpolated from a ``???``,
    e.g. critic.model.path from the actor's) as ``MISSING`` where to_object refuses it: the sections holding one
    are built field by field, the rest by to_object itself."""
    try:
        return OmegaConf.to_object(node)
    except _UNSET:
        pass
    values = {}
    for key in node.keys():
        try:
            child = node[key]
        except _UNSET:
            values[key] = MISSING
            continue
        structured = isinstance(child, DictConfig) and dataclasses.is_dataclass(OmegaConf.get_type(child))
        values[key] = _to_object(child) if structured else (
            OmegaConf.to_object(child) if OmegaConf.is_config(child) else child)
    cls = OmegaConf.get_type(node)
    init = {f.name for f in dataclasses.fields(cls) if f.init}
    tree = cls(**{key: value for key, value in values.items() if key in init})
    for key, value in values.items():  # as to_object does with keys the dataclass does not declare
        if key not in init:
            setattr(tree, key, value)
    return tree


def _override_keys(overrides: Sequence[str]) -> list[str]:
    """``key`` of each ``key=value`` / ``+key=value`` / ``~key`` override (a group's, e.g. ``experiment``, too:
    no recipe key is named like one)."""
    return [o.lstrip("+~").split("=", 1)[0] for o in overrides if "=" in o or o.startswith("~")]
