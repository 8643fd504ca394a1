"""A worker group: one Ray actor per rank, and the registered worker methods as local calls.

``wg.compute_log_prob(data)`` splits ``data`` as the method's ``@register`` spec says, runs it on the
ranks, waits (with a deadline) and combines the results; ``wg.compute_log_prob.async_(data)`` returns a
``PendingCall`` at once. A colocated group (several roles in one process per rank) hands out one
``RoleGroup`` per role with ``spawn()``.
"""
from __future__ import annotations

import os
import time
from typing import Any, Mapping

import ray

from megatron_rl.controller import call_stats
from megatron_rl.controller.decorator import MethodSpec, registered_methods
from megatron_rl.controller.dispatch import MESH_DISPATCH, CallPlan, plan_call
from megatron_rl.controller.errors import WorkerError, wait_for_results
from megatron_rl.controller.mesh import RankMesh, check_mesh
from megatron_rl.controller.resource_pool import RankSlot, RayResourcePool, master_endpoint
from megatron_rl.controller.worker import Worker
from megatron_rl.distributed.device import GPU_ID_ENV, NODE_ID_ENV
from megatron_rl.protocol import DataProto

__all__ = ["RayWorkerGroup", "RoleGroup", "GroupMethod", "PendingCall"]

ROLE_SEPARATOR = "__"  # colocated methods are named "<role>__<method>"


class PendingCall:
    """A group call still running on the workers; ``get()`` waits for every rank and combines the results."""

    def __init__(self, refs: list[ray.ObjectRef], plan: CallPlan, role: str, method: str, timeout_s: float,
                 timeout_key: str = "ray_init.timeout_s", started: float | None = None, sent_bytes: int = 0) -> None:
        self.refs = refs
        self._plan, self._role, self._method, self._timeout_s = plan, role, method, timeout_s
        self._timeout_key = timeout_key  # the config key that sets this deadline, for the error
        self._started = time.perf_counter() if started is None else started
        self._sent_bytes = sent_bytes

    @property
    def ranks(self) -> list[int]:
        return self._plan.ranks

    def done(self) -> bool:
        _, pending = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return not pending

    def get(self, timeout_s: float | None = None) -> Any:
        """The combined result; raises a WorkerError naming role, method and rank on any failure."""
        timeout = self._timeout_s if timeout_s is None else timeout_s
        timed = wait_for_results(self.refs, self._plan.ranks, self._role, self._method, timeout,
                                 timeout_key=self._timeout_key)
        outputs = [result for result, _ in timed]
        combined = self._plan.collect(outputs)
        if call_stats.is_recording():
            call_stats.record_call(f"{self._role}.{self._method}", time.perf_counter() - self._started,
                                   max(seconds for _, seconds in timed), self._sent_bytes,
                                   call_stats.payload_bytes(outputs))
        return combined


class GroupMethod:
    """A registered worker method, called on the whole group."""

    def __init__(self, target: "RoleGroup", name: str, spec: MethodSpec, doc: str | None) -> None:
        self._target, self._name, self.spec = target, name, spec
        self.__doc__ = doc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pending = self.async_(*args, **kwargs)
        return pending.get() if self.spec.blocking else pending

    def async_(self, *args: Any, **kwargs: Any) -> PendingCall:
        started = time.perf_counter()
        target = self._target
        mesh = target.mesh() if self.spec.dispatch_mode in MESH_DISPATCH else None
        plan = plan_call(self.spec, args, kwargs, target.world_size, f"{target.role}.{self._name}", mesh)
        return target.submit(self._name, plan, started)

    def __repr__(self) -> str:
        return f"<GroupMethod {self._target.role}.{self._name} {self.spec.dispatch_mode.name}>"


class RoleGroup:
    """The methods of one role on every rank of a worker group (the whole group, or one colocated role)."""

    def __init__(self, group: "RayWorkerGroup", role: str, prefix: str, worker_cls: type) -> None:
        self._group, self.role, self._prefix, self._worker_cls = group, role, prefix, worker_cls
        self._mesh: list[RankMesh] | None = None
        for name, spec in registered_methods(worker_cls).items():
            if not name.startswith(prefix):
                continue
            short = name[len(prefix):]
            if hasattr(self, short):
                raise ValueError(f"{worker_cls.__name__}.{name}: the name {short!r} is taken by the worker group "
                                 f"itself ({type(self).__name__}.{short}); rename the worker method")
            setattr(self, short, GroupMethod(self, short, spec, getattr(worker_cls, name).__doc__))

    @property
    def group(self) -> "RayWorkerGroup":
        return self._group

    @property
    def world_size(self) -> int:
        return self._group.world_size

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call any public worker method on every rank with the same arguments; results by rank."""
        plan = CallPlan(list(range(self.world_size)), [(args, kwargs)] * self.world_size, list)
        return self.submit(method, plan).get()

    def mesh(self) -> list[RankMesh]:
        """Every rank's model-parallel coordinates, asked once from the workers and then cached."""
        if self._mesh is None:
            reports = self.execute_all("mesh_info")
            check_mesh(reports, self.role)
            self._mesh = reports
        return self._mesh

    def submit(self, method: str, plan: CallPlan, started: float | None = None) -> PendingCall:
        remote_name = self._prefix + method
        if not callable(getattr(self._worker_cls, remote_name, None)):
            raise AttributeError(f"{self.role}: worker class {self._worker_cls.__name__} has no method {remote_name!r}")
        sent = 0
        if call_stats.is_recording():
            sent = call_stats.payload_bytes([v for args, kwargs in plan.calls for v in (*args, *kwargs.values())])
        refs = self._group.call_ranks(remote_name, plan.ranks, plan.calls, plan.used)
        timeout_s, timeout_key = self._group.deadline(method)
        return PendingCall(refs, plan, self.role, method, timeout_s, timeout_key, started, sent)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.role!r} world_size={self.world_size}>"


def _hosted_class(worker_cls: type[Worker], role: str) -> type:
    """``worker_cls`` with the rank's variables set before its __init__ reads them.

    Set in-process rather than through each actor's runtime_env: identical runtime_envs let Ray reuse
    its prestarted worker processes, which halves start-up time on small machines.
    """

    class Hosted(worker_cls):  # type: ignore[misc, valid-type]
        def __init__(self, rank_env: Mapping[str, str], /, **init_args: Any) -> None:
            os.environ.update(rank_env)
            os.environ.update(_ray_place_env())
            super().__init__(**init_args)

        def __repr__(self) -> str:  # Ray prefixes the worker's log lines with this
            return f"{role}:{os.environ.get('RANK', '?')}"

        def _timed_call(self, method: str, keep_result: bool, /, *args: Any, **kwargs: Any) -> tuple[Any, float]:
            """Every group call comes through here: (the result, or None where the driver does not read it,
            so it is neither serialised nor sent; seconds spent in the method)."""
            start = time.perf_counter()
            result = getattr(self, method)(*args, **kwargs)
            return (result if keep_result else None), time.perf_counter() - start

    Hosted.__name__ = Hosted.__qualname__ = worker_cls.__name__
    return Hosted


def _ray_place_env() -> dict[str, str]:
    """The node and the GPU Ray gave this actor. Ray workers see every GPU of their node (init_ray sets
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, since one rollout engine spans several), so the device a
    rank binds comes from here, not from its bundle index."""
    env = {NODE_ID_ENV: ray.get_runtime_context().get_node_id()}
    gpu_ids = ray.get_gpu_ids()
    if gpu_ids:
        env[GPU_ID_ENV] = str(int(gpu_ids[0]))
    return env


def _check_worker_cls(worker_cls: Any) -> None:
    if isinstance(worker_cls, ray.actor.ActorClass):
        raise TypeError("RayWorkerGroup takes the plain worker class, not ray.remote(...) of it")
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
        raise TypeError(f"worker_cls must be a subclass of megatron_rl.controller.Worker, got {worker_cls!r}")


class RayWorkerGroup(RoleGroup):
    """One Ray actor per rank of ``resource_pool``, running ``worker_cls(**init_args)``.

    Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and a MASTER_ADDR/MASTER_PORT
    free on rank 0's node, so its ``torch.distributed.init_process_group("env://")`` just works.
    ``env_vars`` are set in every rank's process before it starts. Waiting on any call is bounded by
    ``timeout_s``, or by ``method_timeouts[method]`` = (seconds, config key named in the error) for the
    methods it lists (the trainer gives init/load, generate, update and save their own deadlines). The
    constructor returns once every rank's __init__ has finished.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        worker_cls: type[Worker],
        init_args: Mapping[str, Any] | None = None,
        name_prefix: str | None = None,
        env_vars: Mapping[str, str] | None = None,
        timeout_s: float = 600.0,
        method_timeouts: Mapping[str, tuple[float, str]] | None = None,
    ) -> None:
        _check_worker_cls(worker_cls)
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.method_timeouts = dict(method_timeouts or {})
        for method, (seconds, key) in self.method_timeouts.items():
            if seconds <= 0:
                raise ValueError(f"{key} must be > 0, got {seconds} (the deadline of {method})")
        role = name_prefix or worker_cls.__name__
        self.timeout_s = timeout_s
        self.resource_pool = resource_pool
        slots = resource_pool.rank_slots(timeout_s)
        master_addr, master_port = master_endpoint(resource_pool.node_id_of(slots[0]), timeout_s)
        actor_cls = ray.remote(_hosted_class(worker_cls, role))
        runtime_env = {"env_vars": {k: str(v) for k, v in env_vars.items()}} if env_vars else None
        self._actors = [
            actor_cls.options(
                scheduling_strategy=slot.scheduling_strategy(),
                runtime_env=runtime_env,
                **resource_pool.actor_resources(),
            ).remote(_rank_env(slot, len(slots), master_addr, master_port), **dict(init_args or {}))
            for slot in slots
        ]
        self.master_addr, self.master_port = master_addr, master_port
        ready = [actor.__ray_ready__.remote() for actor in self._actors]
        try:
            wait_for_results(ready, list(range(len(slots))), role, "__init__", timeout_s)
        except WorkerError:
            self.kill()  # the other ranks may wait forever for the failed one (e.g. in a rendezvous)
            raise
        super().__init__(self, role, "", worker_cls)

    @property
    def world_size(self) -> int:
        return len(self._actors)

    def deadline(self, method: str) -> tuple[float, str]:
        """(seconds, config key) bounding a call of ``method`` (the bare name, without a role prefix)."""
        return self.method_timeouts.get(method, (self.timeout_s, "ray_init.timeout_s"))

    def call_ranks(self, method: str, ranks: list[int], calls: list[tuple[tuple, dict]],
                   used: list[int] | None = None) -> list[ray.ObjectRef]:
        """Start ``method`` on each of ``ranks`` with its (args, kwargs); a DataProto shared by several
        ranks goes into the object store once. Each ref resolves to (result, seconds in the method); the
        result is None at the positions outside ``used`` (None: all are used)."""
        stored: dict[int, ray.ObjectRef] = {}

        def share(value: Any) -> Any:
            if not isinstance(value, DataProto):
                return value
            if id(value) not in stored:
                stored[id(value)] = ray.put(value)
            return stored[id(value)]

        refs = []
        for position, (rank, (args, kwargs)) in enumerate(zip(ranks, calls)):
            keep = used is None or position in used
            refs.append(self._actors[rank]._timed_call.remote(method, keep, *[share(a) for a in args],
                                                              **{k: share(v) for k, v in kwargs.items()}))
        return refs

    def spawn(self) -> dict[str, RoleGroup]:
        """One handle per role of a colocated worker class; its methods route to that role's instance."""
        roles = getattr(self._worker_cls, "colocated_roles", None)
        if not roles:
            raise TypeError(f"{self.role}: spawn() needs a class from create_colocated_worker_cls, "
                            f"got {self._worker_cls.__name__}")
        return {role: RoleGroup(self, role, role + ROLE_SEPARATOR, self._worker_cls) for role in roles}

    def kill(self) -> None:
        """End every rank's process now (e.g. after a failure left the others stuck in a collective)."""
        for actor in self._actors:
            ray.kill(actor, no_restart=True)


def _rank_env(slot: RankSlot, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    return {
        "RANK": str(slot.rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(slot.local_rank),
        "LOCAL_WORLD_SIZE": str(slot.local_world_size),
        "NODE_RANK": str(slot.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
