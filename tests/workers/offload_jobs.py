"""Rank jobs of test_offload.py: a colocated step's phases with param/optimizer offload, against the same
steps without it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from workers_jobs import ROLLOUT_N, actor_config, training_batch, update, weights

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel


def _actor(model_dir: str, tp: int, **megatron: Any):
    from megatron_rl.workers import ActorRole, MegatronEngine

    config = actor_config(tp=tp)
    config = replace(config, megatron=replace(config.megatron, **megatron))
    return ActorRole(MegatronEngine(model_dir, config.megatron, config.optim), config, rollout_n=ROLLOUT_N)


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def _step(actor, seed: int) -> dict[str, Any]:
    """One colocated step as the hybrid worker runs it: generate (state away), log-probs, update, export."""
    engine = actor.engine
    out: dict[str, Any] = {}
    engine.offload.enter("generate")
    params = [p for chunk in engine.model for p in chunk.parameters()]
    out["weights_bytes_in_generate"] = _storage_bytes(params)
    out["host_bytes_in_generate"] = engine.offload.host_bytes()
    data = training_batch(seed=seed)
    out["log_probs"] = actor.compute_log_prob(data).batch["old_log_probs"]
    out["metrics"] = update(actor, data)
    out["host_bytes_after_update"] = engine.offload.host_bytes()
    out["weights"] = weights(actor)  # the export to the engine (export_buckets)
    return out


def offload_job(model_dir: str, tp: int) -> dict[str, Any]:
    init_model_parallel(tp=tp)
    out: dict[str, Any] = {}
    both = {"param_offload": True, "optimizer_offload": True}
    for name, flags in (("plain", {}), ("offload", both), ("params_only", {"param_offload": True}),
                        ("bf16_plain", {"params_dtype": "bf16"}), ("bf16_offload", {"params_dtype": "bf16", **both})):
        torch.manual_seed(0)
        actor = _actor(model_dir, tp, **flags)
        out[f"{name}/steps"] = [_step(actor, seed) for seed in (0, 1)]
        out[f"{name}/log"] = [(e.phase, e.kind, e.to, e.nbytes) for e in actor.engine.offload.log]
        out[f"{name}/residency"] = dict(actor.engine.offload.residency)
    destroy_model_parallel()
    return out
