"""Several roles in one process per rank (verl's hybrid engine): actor + reference + rollout share the
GPU, and the weight sync between them is a copy in memory rather than a transfer.

``create_colocated_worker_cls({"actor_rollout": A, "critic": C})`` builds a worker class that holds one
instance of each role and exposes each role's public methods as ``<role>__<method>`` (keeping their
``@register`` specs); ``RayWorkerGroup.spawn()`` then hands out one handle per role that calls them by
their own names.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from megatron_rl.controller.decorator import attach_spec, method_spec
from megatron_rl.controller.resource_pool import ResourcePoolManager
from megatron_rl.controller.worker import Worker
from megatron_rl.controller.worker_group import ROLE_SEPARATOR, RayWorkerGroup, RoleGroup

__all__ = ["create_colocated_worker_cls", "spawn_role_groups"]


def _check_roles(role_classes: Mapping[str, type]) -> None:
    if not role_classes:
        raise ValueError("create_colocated_worker_cls needs at least one role")
    for role, cls in role_classes.items():
        if not role.isidentifier() or role.startswith("_") or ROLE_SEPARATOR in role:
            raise ValueError(f"role name {role!r} must be an identifier without a leading '_' or {ROLE_SEPARATOR!r}")
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"role {role!r}: {cls!r} is not a subclass of megatron_rl.controller.Worker")


def _public_methods(cls: type) -> list[str]:
    return [name for name in dir(cls) if not name.startswith("_") and callable(getattr(cls, name))]


def _router(role: str, name: str) -> Callable[..., Any]:
    def route(self: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], name)(*args, **kwargs)

    route.__name__ = f"{role}{ROLE_SEPARATOR}{name}"
    return route


def create_colocated_worker_cls(role_classes: Mapping[str, type[Worker]]) -> type[Worker]:
    """A worker class running every role of ``role_classes`` in the same process.

    Its constructor takes one keyword per role holding that role's constructor kwargs:
    ``init_args={"actor_rollout": {"config": cfg}, "critic": {"config": critic_cfg}}``.
    """
    _check_roles(role_classes)
    roles = dict(role_classes)

    class ColocatedWorker(Worker):
        colocated_roles = tuple(roles)

        def __init__(self, **role_init_args: Mapping[str, Any]) -> None:
            unknown = sorted(set(role_init_args) - set(roles))
            if unknown:
                raise TypeError(f"init_args name roles {unknown} that are not colocated here; roles: {sorted(roles)}")
            super().__init__()
            self.roles = {role: cls(**dict(role_init_args.get(role) or {})) for role, cls in roles.items()}

    for role, cls in roles.items():
        for name in _public_methods(cls):
            route = _router(role, name)
            spec = method_spec(getattr(cls, name))
            setattr(ColocatedWorker, route.__name__, attach_spec(route, spec) if spec else route)
    ColocatedWorker.__name__ = ColocatedWorker.__qualname__ = "Colocated_" + "_".join(roles)
    return ColocatedWorker


def spawn_role_groups(
    pools: ResourcePoolManager,
    role_classes: Mapping[str, type[Worker]],
    init_args: Mapping[str, Mapping[str, Any]] | None = None,
    env_vars: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
) -> dict[str, RoleGroup]:
    """Start one worker group per resource pool, colocating the roles that share a pool.

    Returns a handle per role; a role alone in its pool gets a plain RayWorkerGroup.
    """
    missing = sorted(set(role_classes) - set(pools.role_to_pool))
    if missing:
        raise ValueError(f"roles {missing} have no resource pool; mapped roles: {sorted(pools.role_to_pool)}")
    init_args = init_args or {}
    handles: dict[str, RoleGroup] = {}
    for pool_name, pool_roles in pools.roles_by_pool().items():
        roles = [role for role in pool_roles if role in role_classes]
        if len(roles) == 1:
            role = roles[0]
            handles[role] = RayWorkerGroup(pools.pools[pool_name], role_classes[role], init_args.get(role),
                                           name_prefix=role, env_vars=env_vars, timeout_s=timeout_s)
        elif roles:
            cls = create_colocated_worker_cls({role: role_classes[role] for role in roles})
            group = RayWorkerGroup(pools.pools[pool_name], cls, {role: init_args.get(role, {}) for role in roles},
                                   name_prefix="+".join(roles), env_vars=env_vars, timeout_s=timeout_s)
            handles |= group.spawn()
    return handles
