"""Rewards: a scorer registry keyed by ``data_source``, built-in scorers, and the RewardManager.

Importing the package registers the built-in scorers. The manager and ``place_scores`` (which need
torch) are imported on first access, so scoring worker processes stay light.
"""

import importlib
from typing import Any

import megatron_rl.reward.code_execution  # noqa: F401  (registers the code sources' scorer)
import megatron_rl.reward.scorers  # noqa: F401  (registers the built-in scorers)
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

_LAZY = {"RewardManager": "megatron_rl.reward.manager", "place_scores": "megatron_rl.reward.placement"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
