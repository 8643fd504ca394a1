"""Rollout engines (HF everywhere, SGLang on CUDA) and the trainer -> engine weight sync (docs/rollout.md)."""
from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.rollout.hf_engine import HFEngine
from megatron_rl.rollout.weight_sync import WeightSyncError, WeightSyncStats, sync_weights, verify_sync

__all__ = ["RolloutEngine", "WeightUpdateError", "HFEngine", "WeightSyncError", "WeightSyncStats", "sync_weights",
           "verify_sync"]
