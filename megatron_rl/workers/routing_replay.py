"""The roles' side of MoE routing replay (models/router_replay.py): what each pass needs and records.

R3: every trainer pass replays ``batch['routed_experts']`` from the rollout engine. R2: the actor's old-log-prob
pass records its own routing (returned as ``routed_experts``, merged into the batch), the updates replay it.
The reference follows the actor's mode (verl's ref.router_replay defaults to the actor's).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl.config.schema import MegatronParallelConfig
from megatron_rl.models.router_replay import MODE_KEY, ROUTED_EXPERTS, replay_mode, routed_experts_from_choices
from megatron_rl.protocol import DataProto

ROLLOUT_KEY = "actor_rollout_ref.rollout.enable_rollout_routing_replay"


def require_routed_experts(data: DataProto, mode: str, where: str) -> None:
    """Refuse a pass that should replay a routing the batch does not carry, naming the keys."""
    if ROUTED_EXPERTS in data.batch:
        return
    source = (f"the rollout engine ({ROLLOUT_KEY}=true)" if mode == "R3"
              else "the old-log-prob pass (compute_log_prob before update_actor)")
    raise ValueError(f"{where}: {MODE_KEY}={mode} replays batch['{ROUTED_EXPERTS}'], which this batch lacks; "
                     f"it comes from {source}")


def recorded_routed_experts(engine: Any, recorder: Any, data: DataProto) -> torch.Tensor:
    """The routing ``recorder`` (a models.moe_routing.RoutingRecorder) saw in one pass over ``data``, every
    pipeline stage's layers merged: [B, S, L, k] int16 (-1: padding)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if recorder.unsupported is not None:
        raise ValueError(f"{MODE_KEY}=R2 cannot record the routing: {recorder.unsupported}")
    choices = recorder.choices
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each stage recorded its own layers
        everyone: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(everyone, choices, group=parallel_state.get_pipeline_model_parallel_group())
        choices = {layer: rows for stage in everyone for layer, rows in stage.items()}
    return routed_experts_from_choices(choices, data.batch["attention_mask"].cpu(), engine.config.num_layers,
                                       engine.hf_config.moe.topk)


def reference_parallel(
    actor_parallel: MegatronParallelConfig, ref_parallel: MegatronParallelConfig
) -> MegatronParallelConfig:
    """The reference's megatron config with the actor's router_replay mode when its own is disabled."""
    from omegaconf import OmegaConf

    actor = replay_mode(actor_parallel, "actor_rollout_ref.actor.megatron")
    if actor == "disabled" or replay_mode(ref_parallel, "actor_rollout_ref.ref.megatron") != "disabled":
        return ref_parallel
    if OmegaConf.is_config(ref_parallel):
        return OmegaConf.merge(ref_parallel, {"router_replay": {"mode": actor}})
    from dataclasses import replace

    return replace(ref_parallel, router_replay=replace(ref_parallel.router_replay, mode=actor))
