"""The one list of everything megatron-rl uses from SGLang, pinned to one version, and the helpers that
refuse anything not on it.

``SGLANG_CONTRACT`` names every SGLang method, keyword, ServerArgs field, environment variable, HTTP route,
request field and result key the adapter uses; every call goes through ``checked`` and every import through
``import_sglang``, and tests/rollout/test_sglang_contract.py checks the list against the pinned wheel's
source. Version branch: since 0.5.23 (sglang PR #28001) SGLang refuses weight updates outside
``begin_weight_update`` ... ``end_weight_update``; older versions have no session.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from megatron_rl.rollout.base import WeightUpdateError

__all__ = [
    "BUCKET_FORMAT",
    "MEMORY_TAGS",
    "SGLANG_CONTRACT",
    "SGLANG_PIN",
    "WEIGHT_UPDATE_SESSION_SINCE",
    "SGLangServerError",
    "SGLangUnavailableError",
    "check_result",
    "checked",
    "import_sglang",
    "set_agreed_process_env",
]

SGLANG_PIN = "0.5.23"
WEIGHT_UPDATE_SESSION_SINCE = Version("0.5.23")  # sglang PR #28001

# Everything this adapter uses from SGLang. Paths are inside the sglang wheel.
SGLANG_CONTRACT: dict[str, Any] = {
    # srt/entrypoints/engine.py, class Engine: method -> keyword arguments we pass
    "engine_methods": {
        "generate": ("input_ids", "sampling_params", "return_logprob", "return_routed_experts", "image_data"),
        "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
        "begin_weight_update": (),
        "end_weight_update": (),
        "flush_cache": (),
        "release_memory_occupation": ("tags",),
        "resume_memory_occupation": ("tags",),
        "shutdown": (),
    },
    # srt/arg_groups/fields/*.py: ServerArgs fields we pass to sglang.Engine(**kwargs); the user's
    # rollout.engine_kwargs.sglang go beside them, checked against all of SGLang's fields (server_args.py)
    "server_args": (
        "model_path",
        "tp_size",
        "mem_fraction_static",
        "enable_memory_saver",
        "base_gpu_id",
        "skip_tokenizer_init",
        "load_format",
        "random_seed",
        "dtype",
        "log_level",
        "json_model_override_args",  # srt/arg_groups/fields/model.py: config.json overrides, a JSON string
        "nccl_port",  # explicit and distinct per engine: SGLang's own pick collides across ranks seeded alike
        "port",
        "enable_return_routed_experts",  # srt/server_args.py: MoE routing capture (routing replay R3)
    ),
    # ServerArgs fields /server_info reports (srt/utils/common.py build_server_info: server_args.resolved_dict())
    # enable_return_routed_experts: servers asked for routing (R3) must have been started with it; model_path: the
    # async client reads the served model's layers and top-k from it (servers/client.py)
    "server_info_args": ("tp_size", "enable_return_routed_experts", "model_path"),
    # environment variables read by the engine's processes (set before sglang.Engine is built)
    "env_vars": {
        # without it, released CUDA-graph memory stays allocated (srt/model_executor/runner_backend/*)
        "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "true",
    },
    # sglang.Engine() rewrites its caller's process (srt/entrypoints/engine.py _set_envs_and_config). These it
    # leaves alone when already set, and NCCL reads them when a communicator is created: every rank sets them
    # (set_agreed_process_env) before any communicator exists, so leader and members create theirs alike.
    "agreed_env_vars": {
        "NCCL_CUMEM_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    },
    # ... everything else it writes (CUDA_DEVICE_MAX_CONNECTIONS=8, TRTLLM_ENABLE_PDL, CUTE_DSL_*,
    # NCCL_GRAPH_MIXING_SUPPORT, ...; mp.set_start_method("spawn", force=True); a SIGQUIT handler that kills
    # the process tree; its SIGTERM handler) is put back after the engine starts (engine_transport.py), except
    # SGLANG_* variables (SGLANG_RUN_ID), which are the engine's own.
    "kept_env_prefixes": ("SGLANG_",),
    # srt/arg_groups/choices.py LOAD_FORMAT_CHOICES: the engine starts with random weights; ours arrive by sync
    "load_formats": ("dummy",),
    # srt/entrypoints/http_server.py: route -> (request struct in srt/managers/io_struct.py, fields we send)
    "http_routes": {
        # image_data: one list per request (None: text only), each image a data URL (base64 PNG): SGLang's
        # load_image takes data URLs, base64 and paths (srt/utils/common.py); its processor decodes input_ids and
        # matches each image token with one image, expanding it (srt/multimodal/processors/base_processor.py)
        "/generate": ("GenerateReqInput", ("input_ids", "sampling_params", "return_logprob", "return_routed_experts",
                                           "image_data")),
        "/server_info": (None, ()),  # we read "version" and the server_info_args below
        "/flush_cache": (None, ()),
        "/begin_weight_update": ("BeginWeightUpdateReqInput", ()),
        "/end_weight_update": ("EndWeightUpdateReqInput", ()),
        "/update_weights_from_tensor": (
            "UpdateWeightsFromTensorReqInput",
            ("serialized_named_tensors", "load_format", "flush_cache", "weight_version"),
        ),
        "/init_weights_update_group": (
            "InitWeightsUpdateGroupReqInput",
            ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
        ),
        "/update_weights_from_distributed": (
            "UpdateWeightsFromDistributedReqInput",
            ("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format", "weight_version"),
        ),
        "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", ("group_name",)),
        "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", ("tags",)),
        "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", ("tags",)),
        # fully async partial rollouts: "abort" returns in-flight requests with what they generated so far
        # (finish_reason type "abort"); new requests wait until /continue_generation; weight updates while
        # paused do not wait for in-flight requests (srt/managers/tokenizer_manager.py pause_generation)
        "/pause_generation": ("PauseGenerationReqInput", ("mode",)),
        "/continue_generation": ("ContinueGenerationReqInput", ()),
    },
    # srt/sampling/sampling_params.py, class SamplingParams: fields we send
    "sampling_params": (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "sampling_seed",
    ),
    # keys we read from results: /generate (srt/managers/tokenizer_manager.py), /server_info (http_server.py)
    "result_keys": {
        "srt/managers/tokenizer_manager.py": (
            "meta_info",
            "output_token_logprobs",
            "finish_reason",
            "weight_version",
            "routed_experts",  # base64 int32 [prompt + output - 1, layers, top-k]
            "prompt_tokens",  # the prompt served (image tokens expanded): checked for rows with images
        ),
        "srt/entrypoints/http_server.py": ("version", "success", "message"),
    },
    # importable names: module -> attributes
    "symbols": {
        "sglang": ("Engine", "__version__"),
        "sglang.srt.utils.common": ("MultiprocessingSerializer",),  # re-exported by sglang.srt.utils
        "sglang.srt.weight_sync.tensor_bucket": ("FlattenedTensorMetadata",),
        "sglang.srt.utils.patch_torch": ("monkey_patch_torch_reductions",),
    },
    # srt/weight_sync/tensor_bucket.py FlattenedTensorMetadata fields, and the payload dict keys read by
    # srt/model_executor/model_runner_components/weight_updater.py
    "flattened_bucket": {
        "load_format": "flattened_bucket",
        "metadata_fields": ("name", "shape", "dtype", "start_idx", "end_idx", "numel"),
        "payload_keys": ("flattened_tensor", "metadata"),
    },
    "serializer_methods": {"serialize": ("obj", "output_str")},  # MultiprocessingSerializer
    "memory_tags": ("weights", "kv_cache", "cuda_graph"),  # srt/constants.py GPU_MEMORY_ALL_TYPES
}
BUCKET_FORMAT = SGLANG_CONTRACT["flattened_bucket"]
MEMORY_TAGS: tuple[str, ...] = SGLANG_CONTRACT["memory_tags"]


class SGLangUnavailableError(ImportError):
    """sglang is not installed (it needs CUDA)."""


class SGLangServerError(RuntimeError):
    """An SGLang server refused a request or could not be reached; names the URL, route and SGLang's message."""


def set_agreed_process_env() -> dict[str, str]:
    """Set, where the launcher did not, the variables every rank must agree on (``agreed_env_vars``); call on
    every rank of a colocated SGLang run before its first communicator. Returns them as now set."""
    import os

    return {name: os.environ.setdefault(name, value) for name, value in SGLANG_CONTRACT["agreed_env_vars"].items()}


def import_sglang(module: str, name: str) -> Any:
    """Import one SGLang symbol named in the contract, with an actionable error when sglang is missing."""
    if name not in SGLANG_CONTRACT["symbols"].get(module, ()):
        raise AssertionError(f"{module}.{name} is not in SGLANG_CONTRACT['symbols']")
    try:
        mod = __import__(module, fromlist=[name])
    except ImportError as exc:
        raise SGLangUnavailableError(
            f"rollout.name=sglang needs sglang=={SGLANG_PIN} ({exc}). Install it on a CUDA machine with "
            f"`scripts/install_gpu.sh sglang` (SGLang has no CPU build), or use rollout.name=hf."
        ) from exc
    return getattr(mod, name)


def checked(kind: str, key: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse to send SGLang a keyword the contract does not list (so the contract test covers it)."""
    allowed = {
        "engine": lambda: SGLANG_CONTRACT["engine_methods"][key],
        "route": lambda: SGLANG_CONTRACT["http_routes"][key][1],
        "server_args": lambda: SGLANG_CONTRACT["server_args"],
        "sampling": lambda: SGLANG_CONTRACT["sampling_params"],
    }[kind]()
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise AssertionError(f"SGLang {kind} {key or ''}: {unknown} not declared in SGLANG_CONTRACT")
    return kwargs


def check_result(result: Any, what: str) -> Any:
    """SGLang answers control calls with (success, message) or {"success", "message"}."""
    success, message = None, ""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        success, message = result
    elif isinstance(result, dict) and "success" in result:
        success, message = result["success"], result.get("message", "")
    if success is False:
        raise WeightUpdateError(f"SGLang {what} failed: {message}")
    return result
