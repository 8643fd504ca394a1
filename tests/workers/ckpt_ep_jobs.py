"""Rank jobs of test_checkpoint_ep_reshard.py (importable by spawned ranks): actors of a tiny MoE model train at
one expert-parallel layout, save, and resume at another; each side reports its weights and optimizer state as
global tensors, keyed by the model's checkpoint keys and each piece's global offset (so per expert), whatever the
EP / PP / DP layout that holds them (TP stays 1: a TP-split tensor would be other pieces)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from workers_jobs import actor_config, dp_shard, make_actor, training_batch, update


def _pieces(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [piece for value in tree.values() for piece in _pieces(value)]
    if isinstance(tree, (list, tuple)):
        return [piece for value in tree for piece in _pieces(value)]
    return [tree]


def _param_ids(model_sharded: dict[str, Any]) -> dict[int, tuple[str, tuple]]:
    """id(parameter) -> (checkpoint key, global offsets of its pieces) of this rank's main replicas, from the
    model's sharded state dict (a SwiGLU fc1 is a factory of two pieces)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, is_main_replica

    out: dict[int, tuple[str, tuple]] = {}

    def walk(tree: Any) -> None:
        if isinstance(tree, dict):
            for value in tree.values():
                walk(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                walk(value)
        elif isinstance(tree, ShardedTensor) and is_main_replica(tree.replica_id):
            out[id(tree.data)] = (tree.key, (tuple(tree.global_offset),))
        elif isinstance(tree, ShardedTensorFactory) and is_main_replica(tree.replica_id):
            out[id(tree.data)] = (tree.key, tuple(tuple(piece.global_offset) for piece in _pieces(tree.build())))

    walk(model_sharded)
    return out


def global_state(role) -> dict[str, Any]:
    """{(what, key, offsets): tensor} over all ranks: each parameter's weights, its Adam moments (exp_avg,
    exp_avg_sq) and its fp32 master copy (bf16 parameters), read from the torch optimizers themselves (not
    from Megatron's checkpoint mapping); and the Adam steps and how many optimizers Megatron chained."""
    from megatron_rl.models.layout import unwrap

    engine = role.engine
    where: dict[int, tuple[str, tuple]] = {}
    for chunk in engine.model:
        where.update(_param_ids(unwrap(chunk).sharded_state_dict()))
    local: dict[tuple[str, str, tuple], torch.Tensor] = {}
    steps = set()
    for opt in engine.optimizer.chained_optimizers:
        masters = {}
        for params, copies in zip(getattr(opt, "float16_groups", []), getattr(opt, "fp32_from_float16_groups", [])):
            masters.update({id(p): m for p, m in zip(params, copies)})
        if hasattr(opt, "float16_groups"):  # bf16: the bf16 parameters and those kept in fp32 (norms)
            groups = opt.float16_groups + opt.fp32_from_fp32_groups
        else:
            groups = [group["params"] for group in opt.optimizer.param_groups]
        for group in groups:
            for param in group:
                if id(param) not in where:
                    continue  # another rank's main replica
                key, offsets = where[id(param)]
                held = masters.get(id(param), param)  # what Adam updates: the fp32 master copy, else the param
                state = opt.optimizer.state[held]
                local["weight", key, offsets] = param.detach().float().clone()
                local["exp_avg", key, offsets] = state["exp_avg"].detach().clone()
                local["exp_avg_sq", key, offsets] = state["exp_avg_sq"].detach().clone()
                if held is not param:
                    local["fp32_master", key, offsets] = held.detach().clone()
                steps.add(int(state["step"]))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (local, steps))
    merged: dict[tuple[str, str, tuple], torch.Tensor] = {}
    all_steps: set[int] = set()
    for part, part_steps in gathered:
        merged.update(part)
        all_steps |= part_steps
    return {"tensors": merged, "steps": sorted(all_steps), "optimizers": len(engine.optimizer.chained_optimizers)}


def actor_at(model_dir: str, pp: int, ep: int, dtype: str):
    from megatron_rl.distributed import init_model_parallel

    init_model_parallel(tp=1, pp=pp, ep=ep)
    config = actor_config(pp=pp)
    megatron = replace(config.megatron, expert_model_parallel_size=ep, params_dtype=dtype)
    return make_actor(model_dir, replace(config, megatron=megatron))


def reshard_job(model_dir: str, other_dir: str, work: str, dtype: str,
                saves: list[tuple[int, int]], loads: list[tuple[str, int, int]]) -> dict[str, Any]:
    """For each (pp, ep) of ``saves``: an actor takes two PPO updates (non-trivial gradients, Adam steps 2) and
    saves ``work/pp<pp>ep<ep>``. For each (checkpoint name, pp, ep) of ``loads``: an actor built from
    ``other_dir`` (other weights) resumes it. Returns the global states, or the error a load raised."""
    from torch.distributed.checkpoint.api import CheckpointException

    out: dict[str, Any] = {"saved": {}, "loaded": {}}
    for pp, ep in saves:
        role = actor_at(model_dir, pp, ep, dtype)
        for seed in (0, 1):
            update(role, dp_shard(training_batch(seed=seed)))
        name = f"pp{pp}ep{ep}"
        out["saved"][name] = global_state(role)
        role.save_checkpoint(f"{work}/{name}")
        del role
    for name, pp, ep in loads:
        role = actor_at(other_dir, pp, ep, dtype)
        try:
            role.load_checkpoint(f"{work}/{name}")
        except (Exception, CheckpointException) as err:  # reported to the test (DCP's is a BaseException)
            out["loaded"][(name, pp, ep)] = f"{type(err).__name__}: {err}"
        else:
            out["loaded"][(name, pp, ep)] = global_state(role)
            # and it trains on from there: Adam's step 3 with the loaded moments
            out["loaded"][(name, pp, ep)]["next"] = update(role, dp_shard(training_batch(seed=2)))
            out["loaded"][(name, pp, ep)]["next_steps"] = global_state(role)["steps"]
        del role
    return out
