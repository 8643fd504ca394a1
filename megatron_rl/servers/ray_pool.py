"""Rollout servers started from Ray actors on a resource pool of their own (a run under Ray that starts its
servers: ``rollout.mode=server``, ``rollout.num_servers``), for every engine's launch spec (servers/fleet.py
``ServerLaunch``).

Each server's actor (``ServerActor``, titled after its engine: ``ray::HFServerActor``, ``ray::vLLMServerActor``)
starts the server as a child process with fleet.py's ``start_server`` and watches it (``ping``), so Ray places
it: the servers' pool ``rollout_servers`` reserves ``num_servers`` bundles of ``rollout.server_cpus`` CPUs (and
the GPUs the spec asks for on a cluster with GPUs), apart from the trainer's ``global_pool``. The actor's
server sees exactly the GPUs Ray gave the actor, and its spec is computed there, for them (``where_it_runs``).
A dead server or actor (``ray.kill``, a process SIGKILLed, its node lost) is found by ``check()``/``dead()`` and
``replace(i)`` starts a fresh actor on the same bundle.

``rollout.servers_per_node`` spreads the servers over ``ceil(num_servers / servers_per_node)`` Ray nodes (an
engine whose spec names a ``one_node_reason`` refuses it): the pool is then one STRICT_SPREAD placement group
of one bundle per node (its servers' CPUs), so each node's servers are on a node of their own; a replacement
goes back on its node's bundle. Each server reports its node's IP and id (``address()``) and the pool logs
where every server runs.

A server listens on loopback, or on its node's IP when the run spans nodes (``servers_per_node`` set or a Ray
cluster of several nodes), and requires the run's secret on every route (docs/rollout.md, "Security"): the
actor gets it as an argument; the trainer's Ray workers get it from the ``KeyHolder`` actor.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import time
from typing import Any, Iterable

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from megatron_rl.controller.resource_pool import RankSlot, RayResourcePool
from megatron_rl.rollout.server_key import KEY_HOLDER, ensure_server_api_key
from megatron_rl.servers.fleet import ServerLaunch, kill_group, start_server
from megatron_rl.servers.pool import RolloutServerDied, ServerPool, require_servers

__all__ = ["RayServer", "RayServerPool", "ServerActor"]

CPUS_KEY = "actor_rollout_ref.rollout.server_cpus"
PER_NODE_KEY = "actor_rollout_ref.rollout.servers_per_node"

log = logging.getLogger(__name__)


class ServerActor:
    """A Ray actor's body: one server of ``spec`` on this node, a child process of the actor, started and
    watched by it (the actor's bundle is the server's reservation). Ray workers see every GPU of their node
    (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES), so the server gets the GPUs Ray gave this actor."""

    def __init__(self, spec: ServerLaunch, seed: int, api_key: str, node_ip: bool = False) -> None:
        gpus = sorted(ray.get_gpu_ids(), key=lambda g: (len(str(g)), str(g)))  # Ray's ids come as a set
        # loopback unless the run spans nodes (the trainer or the driver may be on another one): the node's IP
        host = ray.util.get_node_ip_address() if node_ip else "127.0.0.1"
        self.server = start_server(spec.where_it_runs(gpus), seed=seed, host=host, api_key=api_key, gpus=gpus)

    def address(self) -> dict[str, Any]:
        """Its URL, processes (the actor's, the server's) and where Ray put it (node, placement group and
        resources of its bundle)."""
        context = ray.get_runtime_context()
        return {"url": self.server.url, "pid": os.getpid(), "server_pid": self.server.proc.pid,
                "log_path": self.server.log_path, "placement_group": context.get_placement_group_id(),
                "resources": context.get_assigned_resources(), "node_id": context.get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}

    def ping(self) -> str | None:
        """None while the server runs; how it ended otherwise."""
        return self.server.exit_status()

    def stop(self) -> None:
        self.server.stop()


@functools.cache
def _actor_class(engine: str) -> Any:
    """``ServerActor`` as a Ray actor class named after its engine (``ps`` tells the servers apart)."""
    named = type(f"{engine}ServerActor", (ServerActor,), {"__module__": __name__})
    return ray.remote(max_restarts=0, max_concurrency=2)(named)  # the second thread answers ping while one starts


class KeyHolder:
    """The run's server secret for its Ray workers (the trainer's sender), which cannot inherit the driver's
    environment: they ask this named actor of the run's Ray job (rollout/server_key.py). Only
    processes that can already call the job's actors (that is, run code in the cluster) can ask."""

    def __init__(self, key: str) -> None:
        self._key = key

    def key(self) -> str:
        return self._key


_KeyHolderClass = ray.remote(num_cpus=0, max_restarts=0)(KeyHolder)


class RayServer:
    """One server's actor as its pool watches it (servers/pool.py ``RolloutServer``)."""

    def __init__(self, index: int, actor: ActorHandle, where: dict[str, Any], ping_timeout_s: float) -> None:
        self.index, self.actor, self.where = index, actor, where
        self.url, self.pid = where["url"], where["pid"]
        self.ping_timeout_s = ping_timeout_s
        self._death: str | None = None
        self._server_stopped = False

    def describe(self) -> str:
        return f"rollout server {self.index} ({self.url}, Ray actor pid {self.pid})"

    def placement(self) -> str:
        return f"rollout server {self.index}: {self.url} on node {self.where['node_id']} ({self.where['node_ip']})"

    def exit_status(self) -> str | None:
        if self._death is None:
            try:
                self._death = ray.get(self.actor.ping.remote(), timeout=self.ping_timeout_s)
            except RayActorError as exc:
                self._death = f"died ({_death_cause(exc)})"
            except GetTimeoutError:
                pass  # alive but slow to answer: busy, not dead
        return self._death

    def stop(self) -> None:
        """The server first (its actor ends it and its children), then the actor."""
        try:
            ray.get(self.actor.stop.remote(), timeout=60)
            self._server_stopped = True
        except Exception:  # noqa: BLE001 - the actor is dead already, or stuck: kill it anyway
            pass
        ray.kill(self.actor, no_restart=True)
        self._death = self._death or "stopped"
        self.end_orphan()

    def end_orphan(self) -> None:
        """A server whose actor could not stop it (the actor died, or Ray is down) runs in a session of its own:
        end its group, where it runs on this node."""
        if self._server_stopped or self.where["node_ip"] != ray.util.get_node_ip_address():
            return
        try:
            os.killpg(int(self.where["server_pid"]), signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.5)
        kill_group(int(self.where["server_pid"]))


def servers_on_nodes(num_servers: int, servers_per_node: int | None) -> list[int]:
    """How many servers each node runs: all on one node (``None``) or ``servers_per_node`` a node, the last
    node taking the rest."""
    if servers_per_node is None:
        return [num_servers]
    if servers_per_node < 1:
        raise ValueError(f"{PER_NODE_KEY} must be >= 1 or null (all servers on one node), got {servers_per_node}")
    nodes = math.ceil(num_servers / servers_per_node)
    return [servers_per_node] * (nodes - 1) + [num_servers - servers_per_node * (nodes - 1)]


def _death_cause(exc: RayActorError) -> str:
    """Ray's reason without the actor's ids or its troubleshooting advice: "The actor is dead because it was
    killed by `ray.kill`." or "... its worker process has died. Worker exit type: ... Worker exit detail: ..."."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    cause = next((line for line in lines if line.startswith("The actor is dead")), lines[-1] if lines else "")
    return cause.split(" Some common causes")[0] or type(exc).__name__


class RayServerPool(ServerPool):
    """``num_servers`` servers of ``spec``, one Ray actor each on a placement group of ``num_servers`` bundles
    of ``cpus_per_server`` CPUs (and the GPUs ``spec.ray_gpus`` asks for) on one node, or with
    ``servers_per_node`` on that many servers per node over several nodes. Ray must be up. ``start_timeout_s``:
    how long the bundles may take to be placed; a server may take its spec's deadline on top."""

    server_actor: Any = None  # the actors' Ray class; None: ``ServerActor`` named after the spec's engine

    def __init__(self, spec: ServerLaunch, num_servers: int, *, cpus_per_server: float,
                 servers_per_node: int | None = None, start_timeout_s: float = 600.0,
                 ping_timeout_s: float = 10.0) -> None:
        require_servers(num_servers)
        if servers_per_node is not None and spec.one_node_reason:
            raise ValueError(f"{PER_NODE_KEY}: {spec.one_node_reason}")
        if cpus_per_server <= 0:
            raise ValueError(f"{CPUS_KEY} must be > 0 (CPUs each server's bundle reserves), got {cpus_per_server}")
        self.spec, self.ping_timeout_s = spec, ping_timeout_s
        self.start_timeout_s = max(start_timeout_s, spec.start_timeout_s + 30)  # the actor's own deadline first
        self.gpus_per_server = spec.ray_gpus(ray.cluster_resources().get("GPU", 0) > 0)
        # the servers bind their node's IP only when the run spans nodes; loopback otherwise
        self.node_ip = servers_per_node is not None or sum(1 for n in ray.nodes() if n.get("Alive")) > 1
        self._key_holder = _KeyHolderClass.options(name=KEY_HOLDER, get_if_exists=True).remote(
            ensure_server_api_key())
        # a CPU server (the HF engine, vLLM-CPU) asks for no GPU; a vLLM server on GPUs for its TP size
        self.resource_pool = RayResourcePool(servers_on_nodes(num_servers, servers_per_node),
                                             use_gpu=self.gpus_per_server > 0,
                                             gpus_per_process=max(1, self.gpus_per_server),
                                             cpus_per_process=cpus_per_server, name="rollout_servers",
                                             distinct_nodes=servers_per_node is not None)
        spread = "" if servers_per_node is None else f" at {PER_NODE_KEY}={servers_per_node}"
        try:
            self.slots = self.resource_pool.rank_slots(start_timeout_s)
        except RuntimeError as exc:
            raise RolloutServerDied(f"actor_rollout_ref.rollout.num_servers={num_servers} servers of "
                                    f"{CPUS_KEY}={cpus_per_server:g} CPUs{spread} do not fit: {exc}") from None
        super().__init__(num_servers)  # a server that fails to start closes the pool (and gives back its bundles)

    def _start_many(self, indices: Iterable[int]) -> list[RayServer]:
        """Start the actors at once (they load in parallel), then wait for each URL."""
        launched = {index: self._launch(self.slots[index], index) for index in indices}
        started = []
        try:
            for index, actor in launched.items():
                started.append(self._await(index, actor))
        except BaseException:
            for server in started:
                server.stop()
            for index in launched.keys() - {server.index for server in started}:
                ray.kill(launched[index], no_restart=True)
            raise
        return started

    def _launch(self, slot: RankSlot, index: int) -> ActorHandle:
        options = {"num_cpus": self.resource_pool.cpus_per_process, "num_gpus": self.gpus_per_server,
                   "scheduling_strategy": slot.scheduling_strategy()}
        actor_class = self.server_actor or _actor_class(self.spec.engine)
        return actor_class.options(**options).remote(self.spec, self.spec.seed + index, self.api_key, self.node_ip)

    def _await(self, index: int, actor: ActorHandle) -> RayServer:
        what = f"{self.spec.engine} rollout server {index} for {self.spec.model_path}"
        try:
            where = ray.get(actor.address.remote(), timeout=self.start_timeout_s)
        except GetTimeoutError:
            raise RolloutServerDied(f"{what} (a Ray actor on pool 'rollout_servers') was not ready within "
                                    f"{self.start_timeout_s:g} s ({self.spec.timeout_key})") from None
        except RayActorError as exc:
            raise RolloutServerDied(f"{what} died before it was ready: {exc}") from None
        server = RayServer(index, actor, where, self.ping_timeout_s)
        log.info("%s", server.placement())  # where each server (and each replacement) runs, for the operator
        return server

    def close(self) -> None:
        if ray.is_initialized():
            super().close()
            self.resource_pool.release()
            ray.kill(self._key_holder)  # the run's secret does not outlive its servers in a Ray that stays up
            return
        for server in self.servers:  # ray.shutdown ended the actors and their pool, not their servers' sessions
            server.end_orphan()
