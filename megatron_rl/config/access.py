"""Reading a config value the same way from the composed DictConfig (what the key-string checks of
config/checks.py see) and from its typed tree (what validation, the planner, the run and the workers hold; a
mandatory path may still be unset in either), and a what-if copy of the typed tree with one value replaced."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

from omegaconf import MISSING, OmegaConf

if TYPE_CHECKING:  # the schema imports Hydra; reading a value needs only OmegaConf (models/ and controller/ use this)
    from megatron_rl.config.schema import MegatronParallelConfig, PPOTrainerConfig

Tree = TypeVar("Tree")  # the typed tree or one of its sections


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


def replace_path(tree: Tree, path: str, value: Any) -> Tree:
    """A copy of the typed tree (or a section of it) with the value at the dotted ``path`` (e.g.
    ``actor_rollout_ref.actor.megatron.use_distributed_optimizer``) replaced: ``dataclasses.replace`` down the path,
    a new dict where the path enters a free-form field (``override_transformer_config.moe_grouped_gemm``). What
    lies off the path is shared with ``tree``, which is left as it was: the planner's what-if plans."""
    head, _, rest = path.partition(".")
    if isinstance(tree, dict):
        return {**tree, head: replace_path(tree[head], rest, value) if rest else value}
    return dataclasses.replace(tree, **{head: replace_path(getattr(tree, head), rest, value) if rest else value})
