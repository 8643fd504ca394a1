"""Rewards: a scorer registry keyed by ``data_source``, built-in scorers, and the RewardManager.

The manager (which needs torch) is imported on first access, so scoring worker processes that import
this package to find a scorer stay light.
"""

from typing import Any

from megatron_rl.reward.custom import FileFunction, load_custom_scorer
from megatron_rl.reward.registry import Scorer, get_scorer, register_scorer, registered_data_sources

__all__ = [
    "FileFunction",
    "RewardManager",
    "Scorer",
    "get_scorer",
    "load_custom_scorer",
    "place_scores",
    "register_scorer",
    "registered_data_sources",
]

_LAZY = {"RewardManager", "place_scores"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from megatron_rl.reward import manager

        return getattr(manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
