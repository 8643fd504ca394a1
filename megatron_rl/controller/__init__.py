"""Ray single controller: ``@register`` dispatch modes, worker groups, resource pools, colocation.

The Ray-free parts (the decorator, ``Worker``, ``RankMesh``) import eagerly; the rest on first use, so a
worker or the torchrun launcher (which use only those) does not import Ray.
"""
from importlib import import_module
from typing import Any

from megatron_rl.controller.decorator import Dispatch, Execute, MethodSpec, register
from megatron_rl.controller.mesh import RankMesh
from megatron_rl.controller.worker import Worker

_LAZY = {
    "create_colocated_worker_cls": "colocation", "spawn_role_groups": "colocation",
    "WorkerError": "errors", "WorkerRaisedError": "errors", "WorkerDiedError": "errors",
    "WorkerTimeoutError": "errors",
    "init_ray": "ray_init", "init_ray_from_config": "ray_init", "shutdown_ray": "ray_init",
    "RayResourcePool": "resource_pool", "ResourcePoolManager": "resource_pool",
    "GroupMethod": "worker_group", "PendingCall": "worker_group", "RayWorkerGroup": "worker_group",
    "RoleGroup": "worker_group",
}

__all__ = [
    "Dispatch", "Execute", "MethodSpec", "register",
    "Worker", "RankMesh",
    "RayResourcePool", "ResourcePoolManager",
    "RayWorkerGroup", "RoleGroup", "GroupMethod", "PendingCall",
    "create_colocated_worker_cls", "spawn_role_groups",
    "WorkerError", "WorkerRaisedError", "WorkerDiedError", "WorkerTimeoutError",
    "init_ray", "init_ray_from_config", "shutdown_ray",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
