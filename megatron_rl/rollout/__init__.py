"""Rollout engines (HF everywhere, SGLang on CUDA) and the trainer -> engine weight sync (docs/rollout.md).

SGLangEngine is imported from ``megatron_rl.rollout.sglang`` (it never imports sglang itself
until an engine is built).
"""

from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.rollout.factory import build_rollout_engine
from megatron_rl.rollout.hf_engine import HFEngine
from megatron_rl.rollout.replica import RolloutReplica
from megatron_rl.rollout.weight_sync import (
    WeightSyncError,
    WeightSyncStats,
    sync_weights,
    verify_sync,
)

__all__ = [
    "HFEngine",
    "RolloutEngine",
    "RolloutReplica",
    "WeightSyncError",
    "WeightSyncStats",
    "WeightUpdateError",
    "build_rollout_engine",
    "sync_weights",
    "verify_sync",
]
