"""Rank jobs of test_megatron_cuda.py (importable by spawned ranks)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))


def megatron_cuda_job(model_dir: str) -> dict[str, Any]:
    from workers_jobs import ROLLOUT_N, actor_config, training_batch, update

    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.models import attention
    from megatron_rl.models.builder import te_available
    from megatron_rl.workers import ActorRole, MegatronEngine

    init_model_parallel(tp=1)
    data = training_batch()
    out: dict[str, Any] = {"te_spec": te_available()}

    def actor(**megatron):
        config = actor_config()
        config = replace(config, megatron=replace(config.megatron, **megatron))
        return ActorRole(MegatronEngine(model_dir, config.megatron, config.optim), config, rollout_n=ROLLOUT_N)

    for name, packed in (("padded", False), ("packed", True)):
        torch.cuda.reset_peak_memory_stats()
        role = actor(packed_sequences=packed)
        out[f"{name}/log_probs"] = role.compute_log_prob(data).batch["old_log_probs"]
        out[f"{name}/metrics"] = update(role, data)
        out[f"{name}/peak_bytes"] = torch.cuda.max_memory_allocated()
        out[f"{name}/attention_kernels"] = sorted(attention._ANNOUNCED_KERNELS)
        out[f"{name}/params"] = sum(p.numel() for chunk in role.engine.model for p in chunk.parameters())
        del role
        torch.cuda.empty_cache()

    role = actor(packed_sequences=True, param_offload=True, optimizer_offload=True)
    update(role, data)  # Adam's state exists from here on
    before = torch.cuda.memory_allocated()
    reference = role.compute_log_prob(data).batch["old_log_probs"]
    role.engine.offload.enter("generate")
    out["offload/freed_bytes"] = before - torch.cuda.memory_allocated()
    out["offload/host_bytes"] = role.engine.offload.host_bytes()
    out["offload/log_probs_equal"] = bool(torch.equal(role.compute_log_prob(data).batch["old_log_probs"], reference))
    destroy_model_parallel()
    return out
