"""Where each rank sits in the model-parallel mesh, as reported by the worker itself.

The controller knows nothing about Megatron: a worker that set up tensor/pipeline/context parallelism
tells the group its coordinates with ``Worker.set_mesh``, and the group learns the data-parallel
layout from those reports.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["RankMesh", "check_mesh", "rollout_leaders"]


@dataclass(frozen=True)
class RankMesh:
    dp_rank: int
    dp_size: int
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    # True on the one rank of each DP group whose output is the group's answer
    # (last pipeline stage, tensor-parallel rank 0, context-parallel rank 0).
    is_collect: bool = True
    # The rollout engine replica this rank belongs to (rollout/mesh.py); only its leader generates.
    rollout_replica: int = 0
    rollout_replicas: int = 1
    is_rollout_leader: bool = True

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"RankMesh: dp_size must be >= 1, got {self.dp_size}")
        if not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"RankMesh: dp_rank {self.dp_rank} is outside dp_size {self.dp_size}")
        for name in ("tp_rank", "pp_rank", "cp_rank"):
            if getattr(self, name) < 0:
                raise ValueError(f"RankMesh: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.rollout_replica < self.rollout_replicas:
            raise ValueError(
                f"RankMesh: rollout_replica {self.rollout_replica} is outside rollout_replicas {self.rollout_replicas}"
            )


def check_mesh(meshes: Sequence[RankMesh | None], role: str) -> int:
    """Validate the ranks' reports as one consistent mesh and return the DP size.

    Every rank must have reported, all must agree on dp_size, and every DP group must have ranks and
    exactly one collecting rank (else its answer would be missing or doubled).
    """
    missing = [rank for rank, mesh in enumerate(meshes) if mesh is None]
    if missing:
        raise RuntimeError(
            f"{role}: ranks {missing} have not reported their parallel mesh; the worker must call "
            "self.set_mesh(...) after setting up model parallelism, before a MEGATRON_COMPUTE_PROTO call"
        )
    sizes = {mesh.dp_size for mesh in meshes}
    if len(sizes) != 1:
        detail = {rank: mesh.dp_size for rank, mesh in enumerate(meshes)}
        raise RuntimeError(f"{role}: ranks disagree on dp_size: {detail}")
    dp_size = sizes.pop()
    for dp_rank in range(dp_size):
        members = [rank for rank, mesh in enumerate(meshes) if mesh.dp_rank == dp_rank]
        collectors = [rank for rank in members if meshes[rank].is_collect]
        if not members:
            raise RuntimeError(f"{role}: no rank reported dp_rank {dp_rank} (dp_size {dp_size})")
        if len(collectors) != 1:
            raise RuntimeError(
                f"{role}: DP group {dp_rank} (ranks {members}) must have exactly one collecting rank, "
                f"found {collectors}"
            )
    return dp_size


def rollout_leaders(meshes: Sequence[RankMesh | None], role: str) -> list[int]:
    """The rank leading each rollout engine replica, by replica index (every replica exactly one)."""
    check_mesh(meshes, role)
    counts = {mesh.rollout_replicas for mesh in meshes}
    if len(counts) != 1:
        raise RuntimeError(f"{role}: ranks disagree on the number of rollout replicas: {sorted(counts)}")
    leaders: list[list[int]] = [[] for _ in range(counts.pop())]
    for rank, mesh in enumerate(meshes):
        if mesh.is_rollout_leader:
            leaders[mesh.rollout_replica].append(rank)
    bad = {replica: ranks for replica, ranks in enumerate(leaders) if len(ranks) != 1}
    if bad:
        raise RuntimeError(f"{role}: every rollout replica needs exactly one leader; replica -> leaders {bad}")
    return [ranks[0] for ranks in leaders]
