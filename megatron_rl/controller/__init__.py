"""Ray single controller: ``@register`` dispatch modes, worker groups, resource pools, colocation."""
from megatron_rl.controller.colocation import create_colocated_worker_cls, spawn_role_groups
from megatron_rl.controller.decorator import Dispatch, Execute, MethodSpec, register
from megatron_rl.controller.errors import WorkerDiedError, WorkerError, WorkerRaisedError, WorkerTimeoutError
from megatron_rl.controller.mesh import RankMesh
from megatron_rl.controller.ray_init import init_ray, shutdown_ray
from megatron_rl.controller.resource_pool import RayResourcePool, ResourcePoolManager
from megatron_rl.controller.worker import Worker
from megatron_rl.controller.worker_group import GroupMethod, PendingCall, RayWorkerGroup, RoleGroup

__all__ = [
    "Dispatch", "Execute", "MethodSpec", "register",
    "Worker", "RankMesh",
    "RayResourcePool", "ResourcePoolManager",
    "RayWorkerGroup", "RoleGroup", "GroupMethod", "PendingCall",
    "create_colocated_worker_cls", "spawn_role_groups",
    "WorkerError", "WorkerRaisedError", "WorkerDiedError", "WorkerTimeoutError",
    "init_ray", "shutdown_ray",
]
