"""HF-engine rollout servers as Ray actors on a resource pool of their own (a run under Ray that starts its
servers: ``rollout.mode=server``, ``rollout.name=hf``, ``rollout.num_servers``).

Each actor's process is one server (servers/hf_server.py: the same routes and weight-update protocol as SGLang),
so generation overlaps with training as with the subprocess pool (servers/pool.py), but Ray places it:
the servers' pool ``rollout_servers`` reserves ``num_servers`` bundles of ``rollout.server_cpus`` CPUs, apart
from the trainer's ``global_pool``. A server binds a free port in its own process and reports its URL, so
servers starting at once never collide. A dead actor (``ray.kill``, its process SIGKILLed, its node lost) is
found by ``check()``/``dead()`` and ``replace(i)`` starts a fresh actor on the same bundle.

``rollout.servers_per_node`` spreads the servers over ``ceil(num_servers / servers_per_node)`` Ray nodes: the
pool is then one STRICT_SPREAD placement group of one bundle per node (its servers' CPUs), so each node's
servers are on a node of their own; a replacement goes back on its node's bundle. Each server reports its
node's IP and id (``address()``) and the pool logs where every server runs.

A server listens on loopback, or on its node's IP when the run spans nodes (``servers_per_node`` set or a Ray
cluster of several nodes), and requires the run's secret on every route (docs/rollout.md, "Security"): the
actor gets it as an argument; the trainer's Ray workers get it from the ``KeyHolder`` actor.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from typing import Any, Iterable

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from megatron_rl.controller.resource_pool import RankSlot, RayResourcePool
from megatron_rl.rollout.server_key import KEY_HOLDER, ensure_server_api_key
from megatron_rl.servers.pool import RolloutServerDied, ServerPool, require_servers

__all__ = ["HFServerActor", "RayRolloutServerPool", "ServerActor"]

CPUS_KEY = "actor_rollout_ref.rollout.server_cpus"
PER_NODE_KEY = "actor_rollout_ref.rollout.servers_per_node"

log = logging.getLogger(__name__)


class HFServerActor:
    """The Ray actor's body: the HF-engine server listening on this node, served by a thread of the actor's
    process (the actor's own thread stays free to answer ``ping``)."""

    def __init__(self, model_path: str, dtype: str, seed: int, threads: int, chunk_tokens: int,
                 api_key: str, node_ip: bool, routed_experts: bool = False) -> None:
        from megatron_rl.servers.hf_server import listen  # lazy: torch, transformers' model classes (actor only)

        # loopback unless the run spans nodes (the trainer or the driver may be on another one): the node's IP
        host = ray.util.get_node_ip_address() if node_ip else "127.0.0.1"
        self.server = listen(model_path, host=host, dtype=dtype, seed=seed, threads=threads, chunk_tokens=chunk_tokens,
                             api_key=api_key, routed_experts=routed_experts)
        self.url = f"http://{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name="hf-server", daemon=True).start()

    def address(self) -> dict[str, Any]:
        """Its URL, process and where Ray put it (node, placement group and CPUs of its bundle)."""
        context = ray.get_runtime_context()
        return {"url": self.url, "pid": os.getpid(), "placement_group": context.get_placement_group_id(),
                "resources": context.get_assigned_resources(), "node_id": context.get_node_id(),
                "node_ip": ray.util.get_node_ip_address()}

    def ping(self) -> bool:
        return True


_ServerActorClass = ray.remote(max_restarts=0, max_concurrency=2)(HFServerActor)


class KeyHolder:
    """The run's server secret for its Ray workers (the trainer's sender), which cannot inherit the driver's
    environment: they ask this named actor of the run's Ray job (rollout/server_key.py). Only
    processes that can already call the job's actors (that is, run code in the cluster) can ask."""

    def __init__(self, key: str) -> None:
        self._key = key

    def key(self) -> str:
        return self._key


_KeyHolderClass = ray.remote(num_cpus=0, max_restarts=0)(KeyHolder)


class ServerActor:
    """One server's actor as its pool watches it (servers/pool.py ``RolloutServer``)."""

    def __init__(self, index: int, actor: ActorHandle, where: dict[str, Any], ping_timeout_s: float) -> None:
        self.index, self.actor, self.where = index, actor, where
        self.url, self.pid = where["url"], where["pid"]
        self.ping_timeout_s = ping_timeout_s
        self._death: str | None = None

    def describe(self) -> str:
        return f"rollout server {self.index} ({self.url}, Ray actor pid {self.pid})"

    def placement(self) -> str:
        return f"rollout server {self.index}: {self.url} on node {self.where['node_id']} ({self.where['node_ip']})"

    def exit_status(self) -> str | None:
        if self._death is None:
            try:
                ray.get(self.actor.ping.remote(), timeout=self.ping_timeout_s)
            except RayActorError as exc:
                self._death = f"died ({_death_cause(exc)})"
            except GetTimeoutError:
                pass  # alive but slow to answer: busy, not dead
        return self._death

    def stop(self) -> None:
        ray.kill(self.actor, no_restart=True)
        self._death = self._death or "stopped"


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


class RayRolloutServerPool(ServerPool):
    """``num_servers`` HF-engine servers of the actor's architecture (``model_path``), one Ray actor each on
    a placement group of ``num_servers`` bundles of ``cpus_per_server`` CPUs (and ``gpus_per_server`` GPUs) on one
    node, or with ``servers_per_node`` on that many servers per node over several nodes. Ray must be up.
    ``routed_experts``: the servers capture their routing (``--enable-return-routed-experts``, routing replay R3)."""

    def __init__(self, model_path: str, num_servers: int, *, cpus_per_server: float,
                 servers_per_node: int | None = None, dtype: str = "float32", seed: int = 0, threads: int = 1,
                 chunk_tokens: int = 8, start_timeout_s: float = 600.0, ping_timeout_s: float = 10.0,
                 gpus_per_server: int = 0, routed_experts: bool = False) -> None:
        require_servers(num_servers)
        self.routed_experts = bool(routed_experts)
        if cpus_per_server <= 0:
            raise ValueError(f"{CPUS_KEY} must be > 0 (CPUs each server's bundle reserves), got {cpus_per_server}")
        self.model_path, self.dtype, self.seed, self.threads = model_path, dtype, seed, threads
        self.chunk_tokens, self.start_timeout_s, self.ping_timeout_s = chunk_tokens, start_timeout_s, ping_timeout_s
        self.gpus_per_server = gpus_per_server
        # the servers bind their node's IP only when the run spans nodes; loopback otherwise
        self.node_ip = servers_per_node is not None or sum(1 for n in ray.nodes() if n.get("Alive")) > 1
        self._key_holder = _KeyHolderClass.options(name=KEY_HOLDER, get_if_exists=True).remote(
            ensure_server_api_key())
        # a CPU server (the HF engine, vLLM-CPU) asks for no GPU; a vLLM server on GPUs for its TP size
        self.resource_pool = RayResourcePool(servers_on_nodes(num_servers, servers_per_node),
                                             use_gpu=gpus_per_server > 0, gpus_per_process=max(1, gpus_per_server),
                                             cpus_per_process=cpus_per_server, name="rollout_servers",
                                             distinct_nodes=servers_per_node is not None)
        spread = "" if servers_per_node is None else f" at {PER_NODE_KEY}={servers_per_node}"
        try:
            self.slots = self.resource_pool.rank_slots(start_timeout_s)
        except RuntimeError as exc:
            raise RolloutServerDied(f"actor_rollout_ref.rollout.num_servers={num_servers} servers of "
                                    f"{CPUS_KEY}={cpus_per_server:g} CPUs{spread} do not fit: {exc}") from None
        super().__init__(num_servers)  # a server that fails to start closes the pool (and gives back its bundles)

    def _start_many(self, indices: Iterable[int]) -> list[ServerActor]:
        """Start the actors at once (they load in parallel), then wait for each URL."""
        launched = {index: self._launch(self.slots[index], index) for index in indices}
        started = []
        try:
            for index, actor in launched.items():
                started.append(self._await(index, actor))
        except BaseException:
            for actor in launched.values():
                ray.kill(actor, no_restart=True)
            raise
        return started

    def _launch(self, slot: RankSlot, index: int) -> ActorHandle:
        options = {"num_cpus": self.resource_pool.cpus_per_process, "num_gpus": self.gpus_per_server,
                   "scheduling_strategy": slot.scheduling_strategy()}
        return _ServerActorClass.options(**options).remote(self.model_path, self.dtype, self.seed + index,
                                                            self.threads, self.chunk_tokens, self.api_key, self.node_ip,
                                                            self.routed_experts)

    def _await(self, index: int, actor: ActorHandle) -> ServerActor:
        try:
            where = ray.get(actor.address.remote(), timeout=self.start_timeout_s)
        except GetTimeoutError:
            raise RolloutServerDied(f"rollout server {index} (a Ray actor on pool 'rollout_servers') did not listen "
                                    f"within {self.start_timeout_s:g} s (ray_init.timeout_s)") from None
        except RayActorError as exc:
            raise RolloutServerDied(f"rollout server {index} for {self.model_path} died before it listened: "
                                    f"{exc}") from None
        server = ServerActor(index, actor, where, self.ping_timeout_s)
        log.info("%s", server.placement())  # where each server (and each replacement) runs, for the operator
        return server

    def close(self) -> None:
        if ray.is_initialized():  # else ray.shutdown already ended the actors and their pool
            super().close()
            self.resource_pool.release()
            ray.kill(self._key_holder)  # the run's secret does not outlive its servers in a Ray that stays up
