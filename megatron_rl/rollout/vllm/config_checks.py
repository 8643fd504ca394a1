"""rollout.name=vllm: the settings vLLM would refuse when it starts, refused before anything starts, naming our keys.

``check_config`` runs in validation (plan/validate.py, also under ``--dry-run``); ``check_here`` in the preflight
of a real start, on the machine that starts the run (vLLM installed, the servers' host, CPU attention's head
sizes). Neither imports vllm.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_rl.config.access import plain
from megatron_rl.config.errors import ConfigError, require
from megatron_rl.config.schema import PPOTrainerConfig, RolloutConfig
from megatron_rl.distributed.device import rollout_on_cpu
from megatron_rl.rollout.vllm import contract
from megatron_rl.rollout.vllm.server import require_local_servers

__all__ = ["check_config", "check_cpu_threads", "check_here"]

ROLLOUT = "actor_rollout_ref.rollout"
# one CPU list of VLLM_CPU_OMP_THREADS_BIND, e.g. 0-3,8
_CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def check_config(cfg: PPOTrainerConfig) -> None:
    """vLLM's own keys and the engine arguments passed through to it."""
    rollout = cfg.actor_rollout_ref.rollout
    vllm = rollout.vllm
    require(isinstance(vllm.cpu_kv_cache_mb, int) and vllm.cpu_kv_cache_mb >= 1,
            f"{ROLLOUT}.vllm.cpu_kv_cache_mb={vllm.cpu_kv_cache_mb} must be an integer >= 1 (MiB of KV cache of a vLLM "
            "engine on CPU)")
    require(vllm.server_start_timeout_s > 0, f"{ROLLOUT}.vllm.server_start_timeout_s={vllm.server_start_timeout_s} "
            "must be > 0 seconds (how long a started vLLM server may take to answer /health)")
    util = rollout.gpu_memory_utilization
    require(0 < util <= 1, f"{ROLLOUT}.gpu_memory_utilization={util} must lie in (0, 1] with rollout.name=vllm (the "
            "fraction of GPU memory vLLM may take; on CPU rollout.vllm.cpu_kv_cache_mb sizes the KV cache)")
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(rollout, key)
        require(isinstance(value, int) and value > 0, f"{ROLLOUT}.{key} must be a positive integer, got {value!r}")
    response = rollout.response_length or cfg.data.max_response_length
    model_len = cfg.data.max_prompt_length + response
    require(rollout.enable_chunked_prefill or rollout.max_num_batched_tokens >= model_len,
            f"{ROLLOUT}.max_num_batched_tokens={rollout.max_num_batched_tokens} is smaller than the engine's "
            f"max_model_len={model_len} (data.max_prompt_length + the response length) with "
            f"{ROLLOUT}.enable_chunked_prefill=false: vLLM could not schedule a full-length prompt and refuses to "
            "start; raise max_num_batched_tokens or set enable_chunked_prefill=true")
    bind = str(vllm.cpu_threads_bind).strip()
    require(bind == "auto" or all(_CPU_LIST.fullmatch(part.strip()) for part in bind.split("|")),
            f"{ROLLOUT}.vllm.cpu_threads_bind={bind!r} must be 'auto' or one CPU list per rollout TP rank separated by "
            "'|', e.g. '0|1' or '0-3|4-7' (vLLM's VLLM_CPU_OMP_THREADS_BIND)")
    if str(cfg.trainer.device) == "cpu":
        check_cpu_threads(cfg)
    _check_engine_kwargs(rollout)


def _check_engine_kwargs(rollout: RolloutConfig) -> None:
    """rollout.engine_kwargs.vllm: only vLLM's own engine arguments that megatron-rl does not set itself, and only
    where they reach the engine."""
    kwargs = plain(rollout.engine_kwargs.vllm)
    if not kwargs:
        return
    key = f"{ROLLOUT}.engine_kwargs.vllm"
    require(rollout.mode != "server" or not rollout.server_urls,
            f"{key}={kwargs} cannot reach vLLM servers started elsewhere ({ROLLOUT}.server_urls): start them with "
            "those arguments and drop the key, or let the run start its servers (rollout.num_servers)")
    contract.check_engine_kwargs(kwargs, key=key)


def check_cpu_threads(cfg: PPOTrainerConfig) -> None:
    """A vLLM engine on CPU with rollout TP > 1 runs one worker process per TP rank, each pinned by
    rollout.vllm.cpu_threads_bind: 'auto' gives rank i the i-th NUMA node's CPUs, which a host with fewer NUMA
    nodes than ranks does not have (vLLM fails at start), so each rank's CPUs are named."""
    rollout = cfg.actor_rollout_ref.rollout
    rtp, bind = rollout.tensor_model_parallel_size, str(rollout.vllm.cpu_threads_bind).strip()
    require(bind != "auto" or rtp == 1,
            f"{ROLLOUT}.vllm.cpu_threads_bind=auto with {ROLLOUT}.tensor_model_parallel_size={rtp} on CPU "
            f"(trainer.device={cfg.trainer.device}): vLLM's automatic binding gives each TP rank a NUMA node of its "
            f"own; set one CPU list per TP rank, e.g. {ROLLOUT}.vllm.cpu_threads_bind="
            f"'{'|'.join(str(i) for i in range(rtp))}'")
    lists = bind.split("|")
    require(bind == "auto" or len(lists) == rtp,
            f"{ROLLOUT}.vllm.cpu_threads_bind={bind!r} names {len(lists)} CPU list(s), but "
            f"{ROLLOUT}.tensor_model_parallel_size={rtp}: give one per TP rank, separated by '|'")


def check_here(cfg: PPOTrainerConfig, read_model_config: Callable[[], dict[str, Any] | None]) -> None:
    """The pinned vLLM is installed here, servers given by URL run on this host (weights reach them through its
    /dev/shm), and on CPU the model's head size is one vLLM's CPU attention runs (else the engine fails when it is
    built, after Ray and the trainer's model are up). ``read_model_config``: the model's config.json (None: no
    model given; validation names that)."""
    try:
        contract.require_vllm()
    except contract.VLLMUnavailableError as err:
        raise ConfigError(str(err)) from None
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode == "server" and rollout.server_urls:
        try:
            require_local_servers(list(rollout.server_urls))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if not rollout_on_cpu(cfg):
        return
    if str(cfg.trainer.device) == "auto":  # validation checked trainer.device=cpu; auto resolved to CPU here
        check_cpu_threads(cfg)
    model_config = read_model_config()
    if model_config is None:
        return
    source = Path(cfg.actor_rollout_ref.model.path) / "config.json"
    head_dim, heads, hidden = (model_config.get(k) for k in ("head_dim", "num_attention_heads", "hidden_size"))
    latent, rope = model_config.get("kv_lora_rank"), model_config.get("qk_rope_head_dim")
    if isinstance(latent, int) and isinstance(rope, int):  # MLA: vLLM caches and attends over the latent
        contract.check_head_size(latent + rope, on_cpu=True, mla=True, model_path=(
            f"actor_rollout_ref.model.path={source.parent} ({source}: kv_lora_rank={latent}, qk_rope_head_dim={rope})"))
        return
    if isinstance(head_dim, int) and head_dim >= 1:
        sizes = f"head_dim={head_dim}"
    elif isinstance(heads, int) and heads >= 1 and isinstance(hidden, int):
        head_dim, sizes = hidden // heads, f"hidden_size={hidden} / num_attention_heads={heads}"
    else:
        return  # the model check names the broken field
    contract.check_head_size(head_dim, on_cpu=True,
                             model_path=f"actor_rollout_ref.model.path={source.parent} ({source}: {sizes})")
