"""Disaggregated placement for a run: the rollout servers the run starts itself, and the trainer that drives
them (the synchronous RLTrainer, or the async loop of ``async_training.mode``: one_step_off, fully_async).

``rollout.mode=server`` with ``rollout.name=hf`` and ``rollout.num_servers=N`` (no ``server_urls``): N
HF-engine servers (servers/hf_server.py, launch spec servers/hf_launch.py) start as processes of their own
before the trainer's workers (under Ray: from actors on their own resource pool, servers/ray_pool.py; under
torchrun: child processes of rank 0's launcher, servers/fleet.py), and their URLs become
``rollout.server_urls``, so trainer rank 0 syncs them exactly as it syncs SGLang servers (gloo update group:
the servers compute on CPU). ``rollout.server_restarts``: how many of those servers may
die over the run and be replaced (servers/restarts.py); 0 fails the run at the first death.

``rollout.name=vllm`` the same way: N vLLM OpenAI-compatible servers (servers/vllm_server.py), Ray actors on
the ``rollout_servers`` pool or child processes, on this host (weights reach them through /dev/shm: trainer rank
0 must run on the same host); the async loops' client is the vLLM one.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_rl.agent.rollout import MultiTurnClient, multi_turn_rollout
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.data.tokenizer import load_tokenizer
from megatron_rl.plan.validate import DerivedSizes, starts_servers
from megatron_rl.rollout.engines import engine_of
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl.servers.fleet import ServerLaunch, ServerProcessPool
from megatron_rl.servers.hf_launch import HFServerLaunch
from megatron_rl.servers.pool import ServerPool
from megatron_rl.servers.restarts import RestartingSync, ServerRestarts
from megatron_rl.servers.vllm_server import VLLMServerRolloutClient, vllm_server_settings
from megatron_rl.trainer.fully_async import FullyAsyncTrainer
from megatron_rl.trainer.off_policy import OneStepOffPolicyTrainer
from megatron_rl.trainer.rl_trainer import RLTrainer

__all__ = ["build_trainer", "start_rollout_servers"]


def start_rollout_servers(cfg: PPOTrainerConfig) -> ServerPool | None:
    """Start the rollout servers the config asks for (``starts_servers``) and point ``rollout.server_urls`` at them."""
    rollout = cfg.actor_rollout_ref.rollout
    if not starts_servers(rollout):
        return None
    return SERVER_LAUNCHERS[engine_of(rollout).name](cfg)


def _hf_launch(cfg: PPOTrainerConfig) -> HFServerLaunch:
    rollout = cfg.actor_rollout_ref.rollout
    return HFServerLaunch(str(cfg.actor_rollout_ref.model.path),
                          dtype="float32" if str(rollout.dtype) == "auto" else str(rollout.dtype),
                          seed=int(rollout.seed), threads=int(rollout.server_threads),
                          chunk_tokens=int(rollout.server_chunk_tokens),
                          # routing replay R3: the servers capture their routing (--enable-return-routed-experts)
                          routed_experts=bool(rollout.enable_rollout_routing_replay),
                          start_timeout_s=float(cfg.ray_init.timeout_s))


def _start_servers(cfg: PPOTrainerConfig, spec: ServerLaunch) -> ServerPool:
    """``rollout.num_servers`` servers of ``spec``: child processes under torchrun (which never imports Ray),
    Ray actors on the servers' own pool otherwise (reserved before the trainer's)."""
    rollout = cfg.actor_rollout_ref.rollout
    if cfg.trainer.launcher == "torchrun":
        return ServerProcessPool(spec, int(rollout.num_servers))
    from megatron_rl.controller import init_ray_from_config  # lazy: Ray
    from megatron_rl.servers.ray_pool import RayServerPool

    init_ray_from_config(cfg.ray_init)
    cpus = rollout.server_cpus if rollout.server_cpus is not None else rollout.server_threads
    return RayServerPool(spec, int(rollout.num_servers), cpus_per_server=float(cpus),
                         servers_per_node=rollout.servers_per_node, start_timeout_s=float(cfg.ray_init.timeout_s))


def _start_hf_servers(cfg: PPOTrainerConfig) -> ServerPool:
    rollout = cfg.actor_rollout_ref.rollout
    pool = _start_servers(cfg, _hf_launch(cfg))
    rollout.server_urls = pool.urls
    rollout.sglang.update_group_backend = "gloo"  # the servers compute on CPU
    # torchrun: the servers listen on this host's loopback. Ray: null, the sender (trainer rank 0, a Ray actor
    # maybe on another node than this driver) names its own node's IP (sglang/server_transport.py
    # update_group_address)
    master = "127.0.0.1" if cfg.trainer.launcher == "torchrun" else None
    rollout.sglang.master_address = rollout.sglang.master_address or master
    return pool


def _start_vllm_servers(cfg: PPOTrainerConfig) -> ServerPool:
    pool = _start_servers(cfg, vllm_server_settings(cfg))
    cfg.actor_rollout_ref.rollout.server_urls = pool.urls
    return pool


# engine (rollout/engines.py, EngineSpec.run_starts_servers) -> how the run starts its servers
SERVER_LAUNCHERS: dict[str, Callable[[PPOTrainerConfig], ServerPool]] = {"hf": _start_hf_servers, "vllm": _start_vllm_servers}


# engine -> the async loops' client of its servers: SGLang's routes (which the HF-engine servers speak too) or
# vLLM's OpenAI-compatible ones
ASYNC_CLIENTS: dict[str, type] = {"hf": ServerRolloutClient, "sglang": ServerRolloutClient,
                                  "vllm": VLLMServerRolloutClient}


def build_trainer(cfg: PPOTrainerConfig, sizes: DerivedSizes, actor_rollout: Any, *args: Any, servers: ServerPool | None,
                  token_ids: dict[str, Any], **kwargs: Any) -> Any:
    """The loop of ``async_training.mode`` (RLTrainer, OneStepOffPolicyTrainer, FullyAsyncTrainer). ``sizes``,
    ``actor_rollout``, ``args``, ``kwargs``: the loops' own. ``token_ids``: eos/pad ids for the driver's
    generation client. With servers the run started, the loop syncs (and the synchronous loop generates)
    through a ``RestartingSync``, which replaces dead servers and retries."""
    restarts = None
    if servers is not None:
        restarts = ServerRestarts(servers, int(cfg.actor_rollout_ref.rollout.server_restarts))
        restarting = RestartingSync(actor_rollout, restarts)
        kwargs["sync"] = restarting.sync_weights
    if cfg.async_training.mode == "sync":
        generate = restarting.generate_sequences if restarts is not None else None
        return RLTrainer(cfg, sizes, actor_rollout, *args, generate=generate, **kwargs)
    rollout = cfg.actor_rollout_ref.rollout
    client_class = ASYNC_CLIENTS[engine_of(rollout).name]
    client = client_class(rollout, list(rollout.server_urls), response_length=cfg.data.max_response_length,
                          timeout_s=rollout.sglang.request_timeout_s, pool=servers, restarts=restarts, **token_ids)
    if rollout.multi_turn.enable:  # every turn of every sample one request of the client's
        tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path, cfg.data.trust_remote_code)
        client = MultiTurnClient(client, multi_turn_rollout(client.generate_sequences, tokenizer, cfg,
                                                            token_ids.get("eos_token_id")))
    loop = FullyAsyncTrainer if cfg.async_training.mode == "fully_async" else OneStepOffPolicyTrainer
    return loop(cfg, sizes, actor_rollout, *args, rollout_client=client, **kwargs)
