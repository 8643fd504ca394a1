"""Base class of every role that a worker group runs: one instance per rank.

It reads its place in the job from the same variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so a worker runs the same under Ray and under torchrun;
outside both it is rank 0 of 1. Megatron is not imported here: a subclass that sets up model
parallelism reports its coordinates with ``set_mesh``.
"""
from __future__ import annotations

import os
from typing import Mapping

from megatron_rl.controller.mesh import RankMesh

__all__ = ["Worker"]


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from None


class Worker:
    def __init__(self) -> None:
        env = os.environ
        self.rank = _env_int(env, "RANK", 0)
        self.world_size = _env_int(env, "WORLD_SIZE", 1)
        self.local_rank = _env_int(env, "LOCAL_RANK", 0)
        self.local_world_size = _env_int(env, "LOCAL_WORLD_SIZE", 1)
        self.master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        self.master_port = _env_int(env, "MASTER_PORT", 29500)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"RANK={self.rank} is outside WORLD_SIZE={self.world_size}")
        self._mesh: RankMesh | None = None

    def set_mesh(
        self,
        *,
        dp_rank: int,
        dp_size: int,
        tp_rank: int = 0,
        pp_rank: int = 0,
        pp_size: int = 1,
        cp_rank: int = 0,
        rollout_replica: int = 0,
        rollout_replicas: int = 1,
        is_rollout_leader: bool = True,
    ) -> None:
        """Report this rank's model-parallel coordinates (call after setting up parallel state), and the
        rollout engine replica it belongs to (``megatron_rl.rollout.mesh``).

        The rank collects for its DP group when it is on the last pipeline stage with tensor- and
        context-parallel rank 0: that is where the full result of a forward pass lives.
        """
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"set_mesh: pp_rank {pp_rank} is outside pp_size {pp_size}")
        self._mesh = RankMesh(
            dp_rank=dp_rank,
            dp_size=dp_size,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            cp_rank=cp_rank,
            is_collect=tp_rank == 0 and cp_rank == 0 and pp_rank == pp_size - 1,
            rollout_replica=rollout_replica,
            rollout_replicas=rollout_replicas,
            is_rollout_leader=is_rollout_leader,
        )

    def mesh_info(self) -> RankMesh | None:
        """What ``set_mesh`` reported, or None before it was called (the group asks for this)."""
        return getattr(self, "_mesh", None)
