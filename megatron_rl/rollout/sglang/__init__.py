"""SGLang as the rollout engine (pinned to sglang==0.5.23; ``scripts/install_gpu.sh sglang``, needs CUDA).

``contract``: the one list of what we use from SGLang. ``adapter.SGLangEngine``: session, version, memory
state, sampling. Transports: ``engine_transport`` (an in-process ``sglang.Engine`` per rollout replica,
colocated) and ``server_transport`` (HTTP servers elsewhere + an update group). ``payload``: one rank's
flattened bucket. sglang itself is imported only when an engine is built.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from megatron_rl.config.access import plain
from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.hf_engine import resolve_dtype
from megatron_rl.rollout.routed_experts import check_can_report
from megatron_rl.rollout.sglang import engine_transport, server_transport
from megatron_rl.rollout.sglang.adapter import SGLangEngine
from megatron_rl.rollout.sglang.contract import (
    SGLANG_CONTRACT,
    SGLANG_PIN,
    WEIGHT_UPDATE_SESSION_SINCE,
    SGLangServerError,
    SGLangUnavailableError,
)
from megatron_rl.rollout.sglang.server_args import check_engine_kwargs
from megatron_rl.rollout.vllm.vision import image_token_id

__all__ = [
    "SGLANG_CONTRACT",
    "SGLANG_PIN",
    "WEIGHT_UPDATE_SESSION_SINCE",
    "SGLangEngine",
    "SGLangServerError",
    "SGLangUnavailableError",
    "build_sglang_engine",
]

#: ServerArgs.dtype spellings (srt/arg_groups: --dtype choices) of the dtypes rollout.dtype resolves to
SGLANG_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def build_sglang_engine(
    config: RolloutConfig,
    model_path: str,
    *,
    replica_index: int = 0,
    base_gpu_id: int = 0,
    response_length: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    model_override: dict[str, Any] | None = None,
    compute_device: str = "cuda",
) -> SGLangEngine:
    """The engine of one rollout replica. ``config``: the rollout config. Colocated: an ``sglang.Engine`` of
    rollout TP on GPUs ``base_gpu_id`` .. + TP - 1 (the replica's leader builds it); server: the servers of
    ``rollout.server_urls`` (global rank 0 builds it). ``model_override``: config.json fields
    (actor_rollout_ref.model.override_config) the colocated engine applies, as SGLang's
    json_model_override_args, so it serves the model the Megatron side built. ``compute_device``: cpu for the
    HF-engine servers (servers/hf_server.py), which speak the same protocol."""
    if config.mode not in ("colocated", "server"):
        raise ValueError(f"rollout.mode must be colocated or server, got {config.mode!r}")
    routing_shape = _routing_shape(config, model_path)
    image_token = image_token_id(model_path)  # a vision-language model: images go with the prompts (adapter.py)
    sgl = config.sglang
    # rollout.dtype resolved here, once, for the engine and the trainer alike: SGLang's own "auto" would serve
    # the checkpoint's dtype (fp16 for an fp32 one) while the trainer casts the synced buckets to bf16.
    dtype = resolve_dtype(str(config.dtype), torch.device(compute_device))
    if config.mode == "server":
        transport = server_transport.ServerTransport(
            list(config.server_urls),
            timeout_s=sgl.request_timeout_s,
            weight_transport=sgl.weight_transport,
            update_group_backend=sgl.update_group_backend,
            master_address=sgl.master_address,
            broken_group_wait_s=sgl.broken_group_wait_s,
            engine=server_transport.server_engine_name(config.name),
            # routing replay R3: the servers must have been started with --enable-return-routed-experts (the
            # run's HF-engine servers are, servers/pool.py); /server_info is checked for it
            routed_experts=routing_shape is not None,
        )
        needs_sync = "the servers have not received the trainer's weights yet"
    else:
        engine_kwargs = plain(config.engine_kwargs.sglang) or {}
        # validation checked them (config_checks.py); a builder called directly meets the same check
        check_engine_kwargs(engine_kwargs, int(config.tensor_model_parallel_size))
        transport = engine_transport.InProcessTransport(
            {
                "model_path": str(model_path),
                "tp_size": int(config.tensor_model_parallel_size),
                "mem_fraction_static": float(config.gpu_memory_utilization),
                "enable_memory_saver": True,  # needed by release/resume_memory_occupation
                "base_gpu_id": int(base_gpu_id),
                # SGLang's multimodal processor needs the tokenizer; token ids still go in and out
                "skip_tokenizer_init": image_token is None,
                "load_format": "dummy",
                "random_seed": int(config.seed),
                "dtype": SGLANG_DTYPE_NAMES[dtype],
                "log_level": "error",
                **({"json_model_override_args": json.dumps(model_override)} if model_override else {}),
                # routing replay R3: SGLang captures each token's experts (rollout/routed_experts.py)
                **({"enable_return_routed_experts": True} if routing_shape is not None else {}),
            },
            replica_index=replica_index,
            port_base=int(sgl.port_base),
            port_stride=int(sgl.port_stride),
            engine_kwargs=engine_kwargs,
        )
        needs_sync = "the engine starts with random weights (load_format=dummy)"
    return SGLangEngine(
        config, transport, response_length=response_length, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, needs_sync=needs_sync, compute_device=compute_device,
        routing_shape=routing_shape, image_token_id=image_token,
    )


def _routing_shape(config: RolloutConfig, model_path: str) -> tuple[int, int] | None:
    """(MoE layers, top-k) of the served model when ``rollout.enable_rollout_routing_replay``, else None."""
    if not bool(getattr(config, "enable_rollout_routing_replay", False)):
        return None
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model_path)
    check_can_report(True, "SGLang", hf)
    return int(hf.num_hidden_layers), int(hf.num_experts_per_tok)
