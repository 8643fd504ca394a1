"""Worker "group" for torchrun: every rank hosts its worker in-process and runs the same driver loop.

Each rank calls the group's methods with the same arguments (the driver loop is deterministic), so a
call is planned exactly as ``RayWorkerGroup`` plans it (``plan_call``); this rank runs its own share
and the ranks' results are exchanged with one ``all_gather_object`` so every rank collects the same
answer. Before the exchange every rank meets on a gloo group with a long timeout
(``distributed.host_group``): a rank with no share of a call (a member while the leaders generate) waits
there, not in the exchange, whose NCCL watchdog would end the job after 10 minutes. Only the results the plan's ``collect`` reads are sent (a MEGATRON_COMPUTE_PROTO call: the DP groups'
collecting ranks), so each rank receives the batch once, not once per model-parallel rank. The worker class, its ``@register`` specs and the trainer are the same as under Ray.
"""
from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist

from megatron_rl.controller.decorator import registered_methods
from megatron_rl.controller.dispatch import MESH_DISPATCH, plan_call
from megatron_rl.controller.worker import Worker
from megatron_rl.distributed.host_group import new_host_group, wait_for_all

__all__ = ["LocalWorkerGroup"]


class LocalWorkerGroup:
    def __init__(self, worker: Worker, role: str) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"{role}: LocalWorkerGroup needs torch.distributed initialised (run under torchrun)")
        self.worker = worker
        self.role = role
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self._specs = registered_methods(type(worker))
        # Ranks outside a call's plan (the members while the leaders generate) wait for it on a gloo group with a
        # long timeout; the exchange itself (NCCL on a cluster, 10-minute watchdog) starts once all are there.
        self._host = new_host_group()
        for name in self._specs:
            setattr(self, name, functools.partial(self._call, name))

    def _mesh(self) -> list[Any]:
        if self.world_size == 1:
            return [self.worker.mesh_info()]
        meshes: list[Any] = [None] * self.world_size
        dist.all_gather_object(meshes, self.worker.mesh_info())
        return meshes

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        spec = self._specs[name]
        mesh = self._mesh() if spec.dispatch_mode in MESH_DISPATCH else None
        plan = plan_call(spec, args, kwargs, self.world_size, f"{self.role}.{name}", mesh)
        result = None
        if self.rank in plan.ranks:
            position = plan.ranks.index(self.rank)
            call_args, call_kwargs = plan.calls[position]
            result = getattr(self.worker, name)(*call_args, **call_kwargs)
            if plan.used is not None and position not in plan.used:
                result = None  # nobody reads it (e.g. a non-collecting TP/PP rank's copy): do not send it
        if self.world_size == 1:  # nothing to exchange: no pickling round trip through the process group
            return plan.collect([result])
        wait_for_all(self._host, f"{self.role}.{name} on ranks {list(plan.ranks)}")
        outputs: list[Any] = [None] * self.world_size
        dist.all_gather_object(outputs, result)
        return plan.collect([outputs[r] for r in plan.ranks])
