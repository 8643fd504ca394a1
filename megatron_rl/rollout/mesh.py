"""The rollout mesh: which ranks form one rollout-engine replica, who leads it, which GPUs it spans.

One engine replica per rollout-TP group, never one per rank: an engine of ``rollout.tensor_model_parallel_size``
= k spans k consecutive GPUs of one node (SGLang's ``base_gpu_id`` .. ``base_gpu_id + k - 1``), is created and
driven by the rank on its first GPU (the leader), and the other k - 1 ranks only contribute their GPU's copy of
each weight bucket. Replicas are the rollout's data parallelism: each generates its share of a batch.

The planner (``default_places``: the launcher's rank layout), the controller's dispatch and the workers (the
places the ranks report at run time) all build the mesh with ``build_rollout_mesh``, so the number of engines
the plan prints and the number the processes build cannot disagree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_rl.distributed.device import RankPlace

__all__ = ["EngineReplica", "RankPlace", "RolloutMesh", "build_rollout_mesh", "default_places", "server_mesh"]

@dataclass(frozen=True)
class EngineReplica:
    index: int
    node: str
    ranks: tuple[int, ...]  # ranks[i] feeds engine TP rank i (its GPU is gpus[i])
    gpus: tuple[int, ...]  # physical GPU ids, consecutive
    base_gpu_id: int  # device index of gpus[0] in the leader's process

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def tp_size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class RolloutMesh:
    tp: int
    replicas: tuple[EngineReplica, ...]

    @property
    def num_engines(self) -> int:
        return len(self.replicas)

    @property
    def leaders(self) -> list[int]:
        return [replica.leader for replica in self.replicas]

    def replica_of(self, rank: int) -> EngineReplica:
        for replica in self.replicas:
            if rank in replica.ranks:
                return replica
        raise KeyError(f"rank {rank} is in no rollout engine replica of {self}")

    def is_leader(self, rank: int) -> bool:
        return self.replica_of(rank).leader == rank

    def describe(self) -> str:
        return "; ".join(
            f"engine {r.index}: ranks {list(r.ranks)} on {r.node} GPUs {list(r.gpus)}" for r in self.replicas
        )


def default_places(world_size: int, gpus_per_node: int) -> list[RankPlace]:
    """The launchers' layout: ranks fill nodes in order, rank r on node r // gpus_per_node, GPU r % gpus_per_node."""
    if world_size < 1 or gpus_per_node < 1:
        raise ValueError(f"world size {world_size} and GPUs per node {gpus_per_node} must be >= 1")
    return [RankPlace(r, f"node{r // gpus_per_node}", r % gpus_per_node, r % gpus_per_node) for r in range(world_size)]


def build_rollout_mesh(places: Sequence[RankPlace], rollout_tp: int) -> RolloutMesh:
    """Partition the ranks into engine replicas of ``rollout_tp`` consecutive GPUs of one node.

    Raises ValueError naming the node when its ranks do not split into such blocks (an engine never spans
    two nodes; SGLang's GPUs are ``base_gpu_id + i``, so a block's GPUs must be consecutive)."""
    if rollout_tp < 1:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size must be >= 1, got {rollout_tp}")
    ranks = sorted(p.rank for p in places)
    if ranks != list(range(len(places))):
        raise ValueError(f"rollout mesh: the ranks' places must cover ranks 0..{len(places) - 1}, got {ranks}")
    by_node: dict[str, list[RankPlace]] = {}
    for place in places:
        by_node.setdefault(place.node, []).append(place)
    blocks: list[list[RankPlace]] = []
    for node, members in by_node.items():
        members.sort(key=lambda p: p.gpu)
        gpus = [p.gpu for p in members]
        if len(set(gpus)) != len(gpus):
            raise ValueError(f"rollout mesh: node {node} has two ranks on one GPU: {_places(members)}")
        if len(members) % rollout_tp:
            raise ValueError(
                f"rollout mesh: node {node} holds {len(members)} ranks, not a multiple of "
                f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp}; an engine cannot span nodes"
            )
        for start in range(0, len(members), rollout_tp):
            block = members[start : start + rollout_tp]
            for offset, place in enumerate(block):
                if (place.gpu - block[0].gpu, place.device_index - block[0].device_index) != (offset, offset):
                    raise ValueError(
                        f"rollout mesh: node {node}: an engine needs {rollout_tp} consecutive GPUs, got "
                        f"{_places(block)}"
                    )
            blocks.append(block)
    blocks.sort(key=lambda block: min(p.rank for p in block))
    replicas = tuple(
        EngineReplica(
            index=i,
            node=block[0].node,
            ranks=tuple(p.rank for p in block),
            gpus=tuple(p.gpu for p in block),
            base_gpu_id=block[0].device_index,
        )
        for i, block in enumerate(blocks)
    )
    return RolloutMesh(rollout_tp, replicas)


def _places(places: Sequence[RankPlace]) -> str:
    return ", ".join(f"rank {p.rank} -> GPU {p.gpu} (device {p.device_index})" for p in places)


def server_mesh(world_size: int) -> RolloutMesh:
    """Server mode: the engines live elsewhere and exactly one trainer rank (0) talks to them; every rank is in
    that one replica (they all take part in the weight export, only rank 0 sends)."""
    ranks = tuple(range(world_size))
    return RolloutMesh(world_size, (EngineReplica(0, "servers", ranks, ranks, 0),))
