"""Turn one driver call into per-rank calls (dispatch) and the ranks' results into one answer (collect).

Pure functions of the arguments and the mesh: no Ray here, so every mode is unit-tested directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatron_rl.controller.decorator import Dispatch, Execute, MethodSpec
from megatron_rl.controller.mesh import RankMesh, check_mesh, rollout_leaders
from megatron_rl.protocol import DataProto

__all__ = ["MESH_DISPATCH", "CallPlan", "plan_call"]

# Modes whose plan depends on where each rank sits (the workers' set_mesh reports).
MESH_DISPATCH = (Dispatch.MEGATRON_COMPUTE_PROTO, Dispatch.ROLLOUT_COMPUTE_PROTO)


@dataclass
class CallPlan:
    ranks: list[int]  # the ranks that run, in the order of ``calls``
    calls: list[tuple[tuple, dict]]  # (args, kwargs) for each of ``ranks``
    collect: Callable[[list[Any]], Any]  # results in ``ranks`` order -> the driver's answer
    # positions in ``ranks`` whose results ``collect`` reads (None: all); the others need not be sent anywhere
    used: list[int] | None = None


def plan_call(
    spec: MethodSpec,
    args: tuple,
    kwargs: dict,
    world_size: int,
    method: str,
    mesh: Sequence[RankMesh] | None = None,
) -> CallPlan:
    """Plan a call of ``method`` under ``spec``; ``mesh`` is needed for MEGATRON_ and ROLLOUT_COMPUTE_PROTO."""
    mode = spec.dispatch_mode
    if spec.execute_mode is Execute.RANK_ZERO:
        return CallPlan([0], [(args, kwargs)], lambda outputs: outputs[0])
    if mode is Dispatch.ONE_TO_ALL:
        return CallPlan(list(range(world_size)), [(args, kwargs)] * world_size, list)
    if mode is Dispatch.RANK_ZERO:
        return CallPlan(list(range(world_size)), [(args, kwargs)] * world_size, lambda outputs: outputs[0], [0])
    if mode is Dispatch.ALL_TO_ALL:
        return CallPlan(list(range(world_size)), _scatter_lists(args, kwargs, world_size, method), list)
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return _plan_data_parallel(args, kwargs, list(range(world_size)), list(range(world_size)), world_size, method)
    if mode is Dispatch.MEGATRON_COMPUTE_PROTO:
        if mesh is None:
            raise ValueError(f"{method}: MEGATRON_COMPUTE_PROTO needs the group's mesh")
        dp_size = check_mesh(mesh, method)
        dp_of_rank = [m.dp_rank for m in mesh]
        collectors = sorted((m.dp_rank, rank) for rank, m in enumerate(mesh) if m.is_collect)
        return _plan_data_parallel(args, kwargs, dp_of_rank, [rank for _, rank in collectors], dp_size, method)
    if mode is Dispatch.ROLLOUT_COMPUTE_PROTO:
        if mesh is None:
            raise ValueError(f"{method}: ROLLOUT_COMPUTE_PROTO needs the group's mesh")
        leaders = rollout_leaders(mesh, method)
        plan = _plan_data_parallel(args, kwargs, list(range(len(leaders))), list(range(len(leaders))),
                                   len(leaders), method)
        # Only the leaders run: replica i's shard goes to leaders[i]; the other ranks hold no engine.
        return CallPlan(leaders, plan.calls, plan.collect)
    raise ValueError(f"{method}: unknown dispatch mode {mode!r}")


def _scatter_lists(args: tuple, kwargs: dict, world_size: int, method: str) -> list[tuple[tuple, dict]]:
    named = {f"argument {i}": a for i, a in enumerate(args)} | {f"argument {k!r}": v for k, v in kwargs.items()}
    for name, value in named.items():
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            seen = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{method} (ALL_TO_ALL): {name} must be a list with one item per rank "
                             f"({world_size}), got {seen}")
    return [(tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world_size)]


def _plan_data_parallel(
    args: tuple, kwargs: dict, dp_of_rank: list[int], collect_ranks: list[int], dp_size: int, method: str
) -> CallPlan:
    """Pad every DataProto argument to a multiple of ``dp_size``, give rank r shard ``dp_of_rank[r]``,
    and concatenate the collecting ranks' DataProto results (ordered by DP rank) before unpadding."""
    shards_of, pad = _shard_data_protos(args, kwargs, dp_size, method)

    def for_dp(dp_rank: int) -> tuple[tuple, dict]:
        shard_args = tuple(shards_of[i][dp_rank] if i in shards_of else a for i, a in enumerate(args))
        shard_kwargs = {k: shards_of[k][dp_rank] if k in shards_of else v for k, v in kwargs.items()}
        return shard_args, shard_kwargs

    per_dp = [for_dp(d) for d in range(dp_size)]  # ranks of one DP group share the same (args, kwargs) objects

    def collect(outputs: list[Any]) -> Any:  # every rank runs, so outputs[r] is rank r's result
        return _concat_results([outputs[r] for r in collect_ranks], collect_ranks, pad, method)

    return CallPlan(list(range(len(dp_of_rank))), [per_dp[d] for d in dp_of_rank], collect, list(collect_ranks))


def _shard_data_protos(
    args: tuple, kwargs: dict, dp_size: int, method: str
) -> tuple[dict[int | str, list[DataProto]], int]:
    protos = {i: a for i, a in enumerate(args) if isinstance(a, DataProto)}
    protos |= {k: v for k, v in kwargs.items() if isinstance(v, DataProto)}
    if not protos:
        raise ValueError(f"{method}: a data-parallel dispatch needs at least one DataProto argument")
    lengths = {key: len(p) for key, p in protos.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{method}: DataProto arguments differ in length: {lengths}")
    shards, pads = {}, set()
    for key, proto in protos.items():
        padded, pad = proto.pad_to_divisor(dp_size)
        shards[key] = padded.chunk(dp_size)
        pads.add(pad)
    return shards, pads.pop()


def _concat_results(outputs: list[Any], ranks: list[int], pad: int, method: str) -> Any:
    """DataProto results become one DataProto without the padding rows; other results a list by DP rank."""
    is_proto = [isinstance(o, DataProto) for o in outputs]
    if all(is_proto):
        merged = DataProto.concat(outputs)
        # A result without rows (metrics in meta_info, e.g. an update) has no padding rows to drop.
        return merged.unpad(pad) if len(merged) else merged
    if any(is_proto):
        kinds = {rank: type(o).__name__ for rank, o in zip(ranks, outputs)}
        raise TypeError(f"{method}: collecting ranks returned a mix of DataProto and other types: {kinds}")
    return outputs
