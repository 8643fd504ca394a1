"""rollout.name=vllm: the settings vLLM would refuse when it starts, refused before anything starts, naming our keys.

``check_config`` runs in validation (plan/validate.py, also under ``--dry-run``); ``check_here`` in the preflight
of a real start, on the machine that starts the run (vLLM installed, the servers' host, CPU attention's head
sizes; the values of rollout.engine_kwargs.vllm against vLLM's own field types, which imports vLLM only then).
``check_config`` does not import vllm.
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

__all__ = ["check_config", "check_cpu_kv_cache", "check_cpu_threads", "check_here"]

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
    # the values of rollout.engine_kwargs.vllm against the installed vLLM's own field types and choices (validation
    # checked their names without importing vLLM; vLLM itself checks the values only when the engine starts)
    contract.check_engine_kwarg_values(plain(rollout.engine_kwargs.vllm) or {}, key=f"{ROLLOUT}.engine_kwargs.vllm")
    contract.check_load_format(str(rollout.load_format), key=f"{ROLLOUT}.load_format")
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
    check_cpu_kv_cache(cfg, model_config, head_dim, source)


# config.json fields of models whose KV cache vLLM sizes otherwise (a window, state of a recurrent layer): the
# lower bound below does not hold for them, so they are left to vLLM
_OTHER_KV_LAYOUTS = ("sliding_window", "layer_types", "attention_chunk_size", "mamba_d_state", "linear_num_key_heads")


def check_cpu_kv_cache(cfg: PPOTrainerConfig, model_config: dict[str, Any], head_dim: int, source: Path) -> None:
    """rollout.vllm.cpu_kv_cache_mb holds one sequence of the engine's max_model_len (data.max_prompt_length + the
    response length), as vLLM requires when it starts (vllm/v1/core/kv_cache_utils.py
    check_enough_kv_cache_memory); refused here by a lower bound of what it needs (K and V of every layer, the
    KV heads of one TP rank, at the dtype the engine serves: rollout.dtype, auto = fp32 on CPU; 1 byte when
    engine_kwargs.vllm.kv_cache_dtype quantises it), so only a cache vLLM surely refuses is refused."""
    rollout = cfg.actor_rollout_ref.rollout
    layers, kv_heads = model_config.get("num_hidden_layers"), (model_config.get("num_key_value_heads")
                                                              or model_config.get("num_attention_heads"))
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and layers >= 1 and kv_heads >= 1):
        return
    if any(model_config.get(name) for name in _OTHER_KV_LAYOUTS):
        return
    kv_dtype = str((plain(rollout.engine_kwargs.vllm) or {}).get("kv_cache_dtype", "auto"))
    element = 1 if kv_dtype != "auto" else {"auto": 4, "fp32": 4, "float32": 4}.get(str(rollout.dtype), 2)
    per_rank_heads = max(1, kv_heads // int(rollout.tensor_model_parallel_size))
    per_token = 2 * layers * per_rank_heads * head_dim * element
    model_len = cfg.data.max_prompt_length + (rollout.response_length or cfg.data.max_response_length)
    need, have = model_len * per_token, int(rollout.vllm.cpu_kv_cache_mb) << 20
    require(need <= have,
            f"{ROLLOUT}.vllm.cpu_kv_cache_mb={rollout.vllm.cpu_kv_cache_mb} cannot hold one sequence of the engine's "
            f"max_model_len={model_len} (data.max_prompt_length + the response length): {source} needs at least "
            f"{per_token} bytes per token ({layers} layers x K and V x {per_rank_heads} KV heads per TP rank x "
            f"head size {head_dim} x {element} bytes), {-(-need // (1 << 20))} MiB; vLLM refuses to start below "
            f"that. Raise {ROLLOUT}.vllm.cpu_kv_cache_mb or shorten the sequences")
