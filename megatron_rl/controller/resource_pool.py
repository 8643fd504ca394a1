"""Where the ranks of a worker group run: one placement group per node, one bundle per process.

A pool with ``distinct_nodes=True`` (the rollout servers spread over nodes) is instead one ``STRICT_SPREAD``
placement group with one bundle per node holding that node's processes, so Ray guarantees each node's share
lands on a node of its own (separate STRICT_PACK groups may share a node).

On a GPU cluster a bundle is one GPU (plus CPUs); on CPU machines it is ``cpus_per_process`` logical
CPUs, so ``ray_init.num_cpus`` decides how many ranks fit on a laptop. Several worker groups may
share a pool (``max_colocate_count``): each actor then asks for that share of its bundle.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from megatron_rl.distributed.ports import free_port

__all__ = ["RayResourcePool", "ResourcePoolManager", "RankSlot", "master_endpoint"]


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs and what it is told about its place."""

    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    placement_group: PlacementGroup
    bundle_index: int

    def scheduling_strategy(self) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=self.bundle_index,
        )


class RayResourcePool:
    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool | None = None,
        cpus_per_process: float = 1.0,
        gpus_per_process: int = 1,
        max_colocate_count: int = 1,
        name: str = "pool",
        distinct_nodes: bool = False,
    ) -> None:
        """``process_on_nodes[i]`` ranks on node i; ``use_gpu=None`` uses GPUs when the cluster has any, then
        ``gpus_per_process`` each (a trainer rank: 1; a rollout server: its tensor-parallel size);
        ``distinct_nodes``: every node's share on a different Ray node."""
        counts = list(process_on_nodes)
        if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"resource pool {name!r}: process_on_nodes must be positive ints, got {counts}")
        if cpus_per_process <= 0:
            raise ValueError(f"resource pool {name!r}: cpus_per_process must be > 0, got {cpus_per_process}")
        if gpus_per_process < 1:
            raise ValueError(f"resource pool {name!r}: gpus_per_process must be >= 1, got {gpus_per_process}")
        if max_colocate_count < 1:
            raise ValueError(f"resource pool {name!r}: max_colocate_count must be >= 1, got {max_colocate_count}")
        self.process_on_nodes = counts
        self.name = name
        self.cpus_per_process = cpus_per_process
        self.gpus_per_process = gpus_per_process
        self.max_colocate_count = max_colocate_count
        self.distinct_nodes = distinct_nodes
        self._use_gpu = use_gpu
        self._placement_groups: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def use_gpu(self) -> bool:
        if self._use_gpu is None:
            self._use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        return self._use_gpu

    def bundle(self) -> dict[str, float]:
        gpus = {"GPU": float(self.gpus_per_process)} if self.use_gpu else {}
        return {"CPU": self.cpus_per_process, **gpus}

    def actor_resources(self) -> dict[str, float]:
        """What one actor of one of ``max_colocate_count`` groups sharing the pool asks for."""
        share = 1.0 / self.max_colocate_count
        return {"num_cpus": self.cpus_per_process * share,
                "num_gpus": self.gpus_per_process * share if self.use_gpu else 0.0}

    def rank_slots(self, timeout_s: float) -> list[RankSlot]:
        """One slot per rank, ranks numbered node by node; placement groups are created on first use."""
        groups = self._reserve(timeout_s)
        slots = []
        for node_rank, count in enumerate(self.process_on_nodes):
            pg = groups[0] if self.distinct_nodes else groups[node_rank]
            for local_rank in range(count):
                bundle_index = node_rank if self.distinct_nodes else local_rank
                slots.append(RankSlot(len(slots), local_rank, count, node_rank, pg, bundle_index))
        return slots

    def node_id_of(self, slot: RankSlot) -> str:
        return placement_group_table(slot.placement_group)["bundles_to_node_id"][slot.bundle_index]

    def release(self) -> None:
        """Give the reserved resources back to Ray (the pool's groups must be killed first)."""
        for pg in self._placement_groups or []:
            remove_placement_group(pg)
        self._placement_groups = None

    def _reserve(self, timeout_s: float) -> list[PlacementGroup]:
        if self._placement_groups is not None:
            return self._placement_groups
        bundle = self.bundle()
        self._check_feasible(bundle)
        if self.distinct_nodes:  # one bundle per node of all its processes' CPUs, each on a node of its own
            node_bundles = [{k: v * count for k, v in bundle.items()} for count in self.process_on_nodes]
            groups = [placement_group(node_bundles, strategy="STRICT_SPREAD")]
        else:
            groups = [placement_group([bundle] * count, strategy="STRICT_PACK") for count in self.process_on_nodes]
        try:
            ray.get([pg.ready() for pg in groups], timeout=timeout_s)
        except GetTimeoutError:
            for pg in groups:
                remove_placement_group(pg)
            raise RuntimeError(
                f"resource pool {self.name!r}: could not reserve {self.process_on_nodes} processes of {bundle} "
                f"within {timeout_s:g} s; free now: {_free_cpus_gpus()} (other groups hold the rest)"
            ) from None
        self._placement_groups = groups
        return groups

    def _check_feasible(self, bundle: Mapping[str, float]) -> None:
        """Fail now, not after a timeout, when no node could ever hold a node's share of the pool (or, for
        ``distinct_nodes``, too few nodes could hold the shares each on its own)."""
        nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
        shares = sorted(self.process_on_nodes, reverse=True) if self.distinct_nodes else self.process_on_nodes
        for nth, count in enumerate(shares, start=1):
            need = {k: v * count for k, v in bundle.items()}
            holding = sum(all(res.get(k, 0) >= v for k, v in need.items()) for res in nodes)
            if holding == 0:
                biggest = max(nodes, key=lambda r: r.get("CPU", 0), default={})
                raise RuntimeError(
                    f"resource pool {self.name!r}: no node can hold {count} processes of {bundle} (needs {need}); "
                    f"largest node has CPU={biggest.get('CPU', 0)} GPU={biggest.get('GPU', 0)}. "
                    "Lower the processes per node or raise ray_init.num_cpus"
                )
            if self.distinct_nodes and holding < nth:  # the nth largest share needs an nth node of its own
                raise RuntimeError(
                    f"resource pool {self.name!r}: {nth} different nodes must each hold {count} or more processes "
                    f"of {bundle} (shares {self.process_on_nodes}), but only {holding} of the {len(nodes)} alive "
                    "nodes can. Lower the nodes the pool spans or add nodes"
                )


def _free_cpus_gpus() -> dict[str, float]:
    free = ray.available_resources()
    return {key: free.get(key, 0.0) for key in ("CPU", "GPU")}


class ResourcePoolManager:
    """Named pools and which role runs in which: roles that share a pool are colocated."""

    def __init__(
        self, pool_spec: Mapping[str, Sequence[int]], role_to_pool: Mapping[str, str], **pool_kwargs: Any
    ) -> None:
        unknown = {role: pool for role, pool in role_to_pool.items() if pool not in pool_spec}
        if unknown:
            raise ValueError(f"roles mapped to undefined resource pools: {unknown}; defined: {sorted(pool_spec)}")
        self.pools = {name: RayResourcePool(nodes, name=name, **pool_kwargs) for name, nodes in pool_spec.items()}
        self.role_to_pool = dict(role_to_pool)

    def pool_for(self, role: str) -> RayResourcePool:
        if role not in self.role_to_pool:
            raise KeyError(f"role {role!r} has no resource pool; mapped roles: {sorted(self.role_to_pool)}")
        return self.pools[self.role_to_pool[role]]

    def roles_by_pool(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for role, pool in self.role_to_pool.items():
            out.setdefault(pool, []).append(role)
        return out


def _free_endpoint() -> tuple[str, int]:
    """This node's IP and a TCP port of it that was free a moment ago (distributed/ports.py)."""
    return ray.util.get_node_ip_address(), free_port("")


_free_endpoint_task = ray.remote(num_cpus=0)(_free_endpoint)


def _on_driver_node(node_id: str) -> bool:
    return node_id == ray.get_runtime_context().get_node_id()


def master_endpoint(node_id: str, timeout_s: float) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT for a group whose rank 0 runs on ``node_id``.

    The port must be free on that node, so off the driver's node a zero-CPU task picks it there.
    """
    if _on_driver_node(node_id):
        return _free_endpoint()
    strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
    try:
        return ray.get(_free_endpoint_task.options(scheduling_strategy=strategy).remote(), timeout=timeout_s)
    except GetTimeoutError:
        raise RuntimeError(f"could not pick a MASTER_PORT on node {node_id} within {timeout_s:g} s") from None
