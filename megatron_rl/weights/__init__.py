"""Weights on their way out of training: Megatron shards -> HF-named buckets -> rollout engines or a directory.

``export``: the shard-first, bucketed Megatron -> HF export (``ExportPlan`` says who materialises what, and the
bucket size). ``sync``: buckets into one engine, versioned. ``replica``: every trainer rank's part of a sync and
of its verification. ``verify``: the log-prob probe that checks an engine serves what was sent. The container a
weight travels in is ``megatron_rl.bucket.WeightBucket``.

Names are resolved lazily: ``export`` imports Megatron-Core, which takes seconds.
"""
from importlib import import_module
from typing import Any

_EXPORTS = {
    "ExportPlan": "export",
    "export_hf_buckets": "export",
    "export_hf_weights": "export",
    "export_hf_weights_tensorwise": "export",
    "save_hf_checkpoint": "export",
    "RolloutReplica": "replica",
    "WeightSyncError": "sync",
    "WeightSyncStats": "sync",
    "sync_weights": "sync",
    "verify_sync": "verify",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_rl.weights' has no attribute {name!r}")
    return getattr(import_module(f"megatron_rl.weights.{_EXPORTS[name]}"), name)
