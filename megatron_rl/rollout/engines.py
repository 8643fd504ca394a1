"""The rollout engines (``actor_rollout_ref.rollout.name``: hf | sglang | vllm), each declared once.

Every decision that depends on which engine runs reads that engine's ``EngineSpec``: its config checks (before
anything starts), what the machine starting the run must have, its builder, where a colocated replica's engine
runs, how weights reach its tensor-parallel ranks, whether the run can start its servers, and the planner's model
of its memory knob. ``engine_of`` is the one reader of ``rollout.name``. Adding an engine is a package under
rollout/ and one ``EngineSpec`` here (and, if the run starts its servers, its servers' launch spec,
servers/fleet.py ``ServerLaunch``, and its async client, both named in trainer/disaggregated.py; the schema's
``RolloutEngineName`` lists the names).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_rl.config.errors import ConfigError
from megatron_rl.config.schema import PPOTrainerConfig, RolloutConfig
from megatron_rl.models.hf_config import load_pretrained_config, needs_rebuilt_config, plain_overrides
from megatron_rl.rollout.memory import EngineMemory, EngineStart, hf_memory, sglang_memory, vllm_memory

if TYPE_CHECKING:  # the engines import torch; validation does not need it
    from megatron_rl.rollout.base import RolloutEngine

__all__ = ["ENGINES", "EngineSpec", "build_rollout_engine", "engine_named", "engine_of"]

ROLLOUT = "actor_rollout_ref.rollout"


@dataclass(frozen=True)
class EngineSpec:
    """One rollout engine, in one place."""

    name: str
    needs_cuda: bool  # no CPU build
    tensor_parallel: bool  # one engine spans rollout.tensor_model_parallel_size ranks (else one model per process)
    run_starts_servers: bool  # rollout.mode=server with rollout.num_servers: the run starts them (trainer/disaggregated.py)
    servers_on_trainer_host: bool  # its servers load weights from /dev/shm of trainer rank 0's host: one node
    # (on GPU, drafts with MTP) -> colocated at TP > 1, every rank sends its own copy of each bucket, made on its
    # GPU (else the leader's full copy serves every TP worker)
    members_send_shards: Callable[[bool, bool], bool]
    reports_routed_experts: bool  # per generated token, for routing replay R3 (rollout/routed_experts.py)
    # colocated, decodes speculatively with the model's MTP layers, which every sync then carries
    # (model.mtp.enable_rollout: models/mtp.py, rollout/vllm/worker_extension.py)
    drafts_with_mtp: bool
    # builds its layers as config.json's quantization_config says (FP8 layers for an FP8 checkpoint), where the
    # trainer syncs the weights it dequantised on load (models/fp8_checkpoint.py)
    builds_quantized_layers: bool
    # its servers take a vision-language prompt's images (vLLM: /inference/v1/generate; SGLang: image_data); the
    # HF-engine servers do not
    servers_take_images: bool
    # it takes a prompt's videos (the HF engine: models/vision_inputs.py; vLLM's and SGLang's are not wired here)
    takes_videos: bool
    memory: Callable[[EngineStart], EngineMemory]  # its meaning of rollout.gpu_memory_utilization (rollout/memory.py)
    build: Callable[..., RolloutEngine]  # (rollout config, model path, **engine kwargs) -> the engine
    # (replica, run config, on GPU) -> the builder's kwargs that place a replica's engine
    placement: Callable[[Any, PPOTrainerConfig, bool], dict[str, Any]]
    # its own keys, in validation (also under --dry-run)
    check_config: Callable[[PPOTrainerConfig], None] = lambda cfg: None
    # preflight of a start: (run config, a reader of the model's config.json) -> None, or ConfigError
    check_here: Callable[[PPOTrainerConfig, Callable[[], dict[str, Any] | None]], None] = (
        lambda cfg, read_model_config: None)
    prepare_process: Callable[[], None] | None = None  # colocated: what every rank sets before any communicator
    # (checkpoint path, device: auto | cpu | cuda) -> the builder's kwargs of an engine that serves a checkpoint as
    # loaded, in this process, and never receives weights (the reward model's judge)
    serve_checkpoint: Callable[[str, str], dict[str, Any]] = lambda path, device: {}
    # () -> what a rank makes of its copy of a bucket for the leader's gather, where members send shards
    bucket_payload: Callable[[], Callable[[Any], Any]] | None = None


def _build_hf(config: RolloutConfig, model_path: str | os.PathLike, *,
              override_config: Mapping[str, Any] | None = None, **kwargs: Any) -> RolloutEngine:
    if config.mode == "server":  # the HF-engine servers (servers/hf_server.py) speak SGLang's routes and weights
        from megatron_rl.rollout.sglang import build_sglang_engine  # lazy: torch, transformers

        return build_sglang_engine(config, str(model_path), **kwargs, compute_device="cpu")
    from megatron_rl.rollout.hf_engine import HFEngine  # lazy: torch, transformers' model classes

    # a config object where transformers cannot read the directory's own (MiMo) or it is overridden
    rebuilt = override_config or needs_rebuilt_config(model_path)
    model_config = load_pretrained_config(model_path, override_config) if rebuilt else model_path
    return HFEngine(config, model_config, **kwargs)


def _build_sglang(config: RolloutConfig, model_path: str | os.PathLike, *,
                  override_config: Mapping[str, Any] | None = None, **kwargs: Any) -> RolloutEngine:
    from megatron_rl.rollout.sglang import build_sglang_engine  # lazy: torch, transformers

    overrides = plain_overrides(override_config)
    return build_sglang_engine(config, str(model_path), **({"model_override": overrides} if overrides else {}),
                               **kwargs)


def _build_vllm(config: RolloutConfig, model_path: str | os.PathLike, *,
                override_config: Mapping[str, Any] | None = None, **kwargs: Any) -> RolloutEngine:
    if config.mode == "server":
        from megatron_rl.rollout.vllm.server import build_vllm_server_engine  # lazy: torch, transformers

        return build_vllm_server_engine(config, str(model_path), **kwargs)
    from megatron_rl.rollout.vllm import VLLMEngine  # lazy: torch, transformers (vLLM when it starts)

    return VLLMEngine(config, model_path, model_override=plain_overrides(override_config) or None, **kwargs)


def _sglang_payload() -> Callable[[Any], Any]:
    from megatron_rl.rollout.sglang.payload import serialize_bucket  # lazy: SGLang's package imports transformers

    return serialize_bucket


def _vllm_payload() -> Callable[[Any], Any]:
    from megatron_rl.rollout.vllm.ipc import bucket_payload  # lazy: torch

    return bucket_payload


def _sglang_placement(replica: Any, cfg: PPOTrainerConfig, on_gpu: bool) -> dict[str, Any]:
    return {"replica_index": replica.index, "base_gpu_id": replica.base_gpu_id}


def _vllm_placement(replica: Any, cfg: PPOTrainerConfig, on_gpu: bool) -> dict[str, Any]:
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode != "colocated":
        return {}  # servers: their own processes, placed where they start (servers/vllm_server.py)
    response = rollout.response_length or cfg.data.max_response_length
    extra = {"max_model_len": cfg.data.max_prompt_length + response, "device": "cuda" if on_gpu else "cpu"}
    mtp = cfg.actor_rollout_ref.model.mtp
    if mtp.enable_rollout:  # drafting with the model's MTP layers (verl's vLLM keys; config/mtp.py)
        extra["speculative"] = {"method": str(mtp.method), "num_speculative_tokens": int(mtp.num_speculative_tokens)}
    if on_gpu:  # vLLM's processes see exactly the replica's GPUs (its own default: GPUs 0..TP-1)
        extra.update(gpus=replica.gpus, replica_index=replica.index)
    return extra


def _hf_serving(path: str, device: str) -> dict[str, Any]:
    return {"weights_path": path, "device": None if device == "auto" else device}


def _vllm_serving(path: str, device: str) -> dict[str, Any]:
    import torch

    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return {"max_model_len": None, "device": "cuda" if cuda else "cpu"}


def _check_sglang(cfg: PPOTrainerConfig) -> None:
    from megatron_rl.rollout.sglang.config_checks import check_config  # lazy: its package imports torch

    check_config(cfg)


def _check_vllm(cfg: PPOTrainerConfig) -> None:
    from megatron_rl.rollout.vllm.config_checks import check_config  # lazy: its package imports torch, transformers

    check_config(cfg)


def _vllm_here(cfg: PPOTrainerConfig, read_model_config: Callable[[], dict[str, Any] | None]) -> None:
    """vLLM's checks of this machine (rollout/vllm/config_checks.py), then, as for the other engines' servers, each
    vLLM server of rollout.server_urls answers (``/v1/models``, the route the client reads the served model from;
    before: a URL nothing listened at was refused only when trainer rank 0 built its engine under Ray)."""
    from megatron_rl.rollout.vllm.config_checks import check_here  # lazy: its package imports torch, transformers

    check_here(cfg, read_model_config)  # servers on this host first: a remote one is refused for that
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode != "server" or not rollout.server_urls:
        return
    from megatron_rl.rollout.server_http import check_reachable  # lazy: as above (torch, transformers)
    from megatron_rl.rollout.sglang.server_transport import PROBE_TIMEOUT_S  # lazy: as above
    from megatron_rl.rollout.vllm.server import VLLMServerHTTP  # lazy: as above

    timeout_s = rollout.sglang.request_timeout_s  # the one HTTP request bound of every engine (server_http.py)
    wait = PROBE_TIMEOUT_S if timeout_s is None else min(float(timeout_s), PROBE_TIMEOUT_S)
    try:
        check_reachable([VLLMServerHTTP(str(url), wait) for url in rollout.server_urls], "/v1/models")
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _servers_here(cfg: PPOTrainerConfig, read_model_config: Callable[[], dict[str, Any] | None]) -> None:
    """Servers started elsewhere (rollout.server_urls) answer the client's first request, made here by preflight
    (before: refused when trainer rank 0 built its engine under Ray, its message naming SGLang whatever the engine)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode != "server" or not rollout.server_urls:
        return
    from megatron_rl.rollout.sglang.server_transport import check_servers_answer  # lazy: its package imports torch

    try:
        check_servers_answer(list(rollout.server_urls), str(rollout.name), rollout.sglang.request_timeout_s)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _sglang_process_env() -> None:
    # a colocated sglang.Engine sets NCCL variables in its leader only: every rank sets the same ones first
    from megatron_rl.rollout.sglang.contract import set_agreed_process_env  # lazy: its package imports torch

    set_agreed_process_env()


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("hf", needs_cuda=False, tensor_parallel=False, run_starts_servers=True, servers_on_trainer_host=False,
               members_send_shards=lambda on_gpu, drafts: True, reports_routed_experts=True, drafts_with_mtp=False,
               builds_quantized_layers=False, servers_take_images=False, takes_videos=True, memory=hf_memory,
               build=_build_hf, placement=lambda replica, cfg, on_gpu: {}, check_here=_servers_here,
               serve_checkpoint=_hf_serving),
    EngineSpec("sglang", needs_cuda=True, tensor_parallel=True, run_starts_servers=False,
               servers_on_trainer_host=False, members_send_shards=lambda on_gpu, drafts: True,
               reports_routed_experts=True, drafts_with_mtp=False, builds_quantized_layers=True,
               servers_take_images=True, takes_videos=False, memory=sglang_memory, bucket_payload=_sglang_payload,
               build=_build_sglang, placement=_sglang_placement, check_config=_check_sglang,
               check_here=_servers_here, prepare_process=_sglang_process_env),
    # vLLM's workers shard full tensors themselves. On CPU (and drafting with MTP) the leader's /dev/shm copy serves
    # every engine TP rank; on GPUs each worker opens the CUDA IPC handle of the copy on its own GPU (vllm/ipc.py)
    EngineSpec("vllm", needs_cuda=False, tensor_parallel=True, run_starts_servers=True, servers_on_trainer_host=True,
               members_send_shards=lambda on_gpu, drafts: on_gpu and not drafts, reports_routed_experts=True,
               drafts_with_mtp=True, builds_quantized_layers=True, servers_take_images=True, takes_videos=False,
               memory=vllm_memory, bucket_payload=_vllm_payload, build=_build_vllm, placement=_vllm_placement,
               check_config=_check_vllm, check_here=_vllm_here, serve_checkpoint=_vllm_serving),
)}


def engine_of(rollout: RolloutConfig) -> EngineSpec:
    """The spec of ``rollout.name`` (``rollout``: actor_rollout_ref.rollout)."""
    return engine_named(str(rollout.name), f"{ROLLOUT}.name")


def engine_named(name: str, key: str) -> EngineSpec:
    """The spec of the engine ``name`` that the config key ``key`` chose (named in the error)."""
    if name not in ENGINES:
        raise ConfigError(f"{key} must be one of {', '.join(ENGINES)}, got {name!r}")
    return ENGINES[name]


def build_rollout_engine(
    config: RolloutConfig,
    model_path: str | os.PathLike,
    *,
    response_length: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    override_config: Mapping[str, Any] | None = None,
    **engine_kwargs: Any,
) -> RolloutEngine:
    """``config``: ``actor_rollout_ref.rollout``; ``model_path``: the actor's HF directory (config, and for
    SGLang the tokenizer); ``response_length``: data.max_response_length, used when ``rollout.response_length`` is
    unset. ``engine_kwargs``: the engine's own (a colocated replica's placement: ``EngineSpec.placement``).
    ``override_config``: actor_rollout_ref.model.override_config, applied to colocated engines as the Megatron
    builder applies it (models.load_pretrained_config); servers never see it (validation refuses it with them)."""
    if config.mode == "server" and override_config:
        raise ValueError(f"actor_rollout_ref.model.override_config={plain_overrides(override_config)} cannot reach "
                         f"{config.name} rollout servers (they load model.path): bake the fields into config.json or "
                         "use rollout.mode=colocated")
    return engine_of(config).build(config, model_path, response_length=response_length, eos_token_id=eos_token_id,
                                   pad_token_id=pad_token_id, override_config=override_config, **engine_kwargs)
