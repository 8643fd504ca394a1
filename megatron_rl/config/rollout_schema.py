"""The rollout section of the structured config schema (``actor_rollout_ref.rollout``), verl's names; the rest of
the tree is config/schema.py's, which re-exports these classes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from megatron_rl.config.choices import (
    EngineDType,
    RolloutEngineName,
    RolloutMode,
    ToolCallFormat,
    TruncateSide,
    UpdateGroupBackend,
    WeightTransport,
)


@dataclass
class WeightSyncConfig:
    bucket_size_mb: int = 512
    verify_freq: int = 1  # verify after every N-th sync; 0 disables
    verify_max_logprob_diff: Optional[float] = None  # fail above this mean-abs difference; null: by dtype (docs/rollout.md)
    probe_batch_size: int = 2


@dataclass
class ValKwargsConfig:
    n: int = 1
    do_sample: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class SGLangConfig:
    """SGLang-only settings (rollout.name=sglang); see docs/rollout.md."""

    weight_transport: WeightTransport = WeightTransport.distributed  # server mode: distributed (NCCL group) | tensor (HTTP payloads)
    update_group_backend: UpdateGroupBackend = UpdateGroupBackend.nccl
    master_address: Optional[str] = None  # this trainer's address as the servers see it
    # One HTTP request to a server (a generate call holds a whole share of the batch; a weight update a bucket).
    # null: wait (a server that dies still fails its request at once); set it to bound a server that hangs.
    request_timeout_s: Optional[float] = None
    # After a weight broadcast failed: how long a server may take to answer it before it counts as stuck in
    # the broken collective (replaced with the dead one, or named in the error).
    broken_group_wait_s: float = 30.0
    # Colocated engines: engine i uses port_base + 2i (and +1); a taken port moves on by port_stride.
    port_base: int = 23000
    port_stride: int = 1000


@dataclass
class EngineKwargsConfig:
    """``rollout.engine_kwargs``: extra arguments for one engine, passed through after a check against that
    engine's own argument set (vLLM: its EngineArgs fields, rollout/vllm/contract.py)."""

    vllm: dict[str, Any] = field(default_factory=dict)
    sglang: dict[str, Any] = field(default_factory=dict)


@dataclass
class VLLMConfig:
    """vLLM-only settings of ours (rollout.name=vllm); see docs/rollout.md, "vLLM"."""

    # CPU: vLLM reads gpu_memory_utilization as a fraction of the host's RAM, so on CPU the KV cache is sized
    # by this instead (vLLM's kv_cache_memory_bytes); GPUs use rollout.gpu_memory_utilization.
    cpu_kv_cache_mb: int = 256
    # CPU: OpenMP threads of each vLLM worker ("auto": vLLM's own binding; "0|1": one CPU list per TP rank, which
    # a TP > 1 engine on a one-NUMA-node host needs; vLLM's VLLM_CPU_OMP_THREADS_BIND)
    cpu_threads_bind: str = "auto"
    # server mode: seconds a started vLLM server may take to answer /health
    server_start_timeout_s: float = 300.0


@dataclass
class MultiTurnConfig:
    """``rollout.multi_turn``: multi-turn, tool-using rollouts through the agent loop (verl's keys; ours below
    them). docs/rollout.md, "Agent loop"."""

    enable: bool = False
    max_assistant_turns: Optional[int] = 5  # model turns per sample
    max_user_turns: Optional[int] = None  # observation turns per sample (None: no limit of its own)
    max_parallel_calls: int = 1  # tool calls run per model turn
    max_tool_response_length: int = 256  # characters of one tool result
    tool_response_truncate_side: TruncateSide = TruncateSide.middle
    tool_config_path: Optional[str] = None  # verl's tool YAML; None: the built-in tools named in `tools`
    format: ToolCallFormat = ToolCallFormat.hermes  # tool-call format: <tool_call>{json}</tool_call>
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    default_agent: str = "tool_agent"  # environment of rows without agent_name
    tool_timeout_s: float = 10.0  # every environment step (tool call) is bounded by this
    num_tool_workers: int = 8  # threads running tool calls while the engine decodes other samples
    python_tool_unsandboxed_ok: bool = False  # run the python tool as root where it cannot drop privileges (docs/rollout.md, Agent loop)
    # an agent program of the user's (module:function or file.py:function) instead of the agent loop: it talks to the
    # model through the run's OpenAI-compatible proxy, each run a sample (megatron_rl/agent/program.py)
    agent_program: Optional[str] = None
    agent_timeout_s: float = 600.0  # each program run of a rollout batch, from the batch's start
    agent_concurrency: int = 32  # program runs at once


@dataclass
class RolloutConfig:
    name: RolloutEngineName = RolloutEngineName.hf
    mode: RolloutMode = RolloutMode.colocated
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    response_length: Optional[int] = None  # None: data.max_response_length
    stop_token_ids: list[int] = field(default_factory=list)
    tensor_model_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    # a preset's gpu_memory_utilization for each engine, which reads it its own way (SGLang: of the memory free at
    # engine start; vLLM: of the GPU's total): presets set gpu_memory_utilization to
    # ${.gpu_memory_utilization_by_engine.${.name}} (docs/launching.md, "Rollout memory per engine")
    gpu_memory_utilization_by_engine: dict[str, float] = field(default_factory=dict)
    log_prob_micro_batch_size_per_gpu: int = 8
    # the old-log-prob pass's token budget (verl's keys; null: the actor's use_dynamic_bsz / ppo_max_token_len_per_gpu)
    log_prob_use_dynamic_bsz: Optional[bool] = None
    log_prob_max_token_len_per_gpu: Optional[int] = None
    free_cache_engine: bool = True
    seed: int = 0
    dtype: EngineDType = EngineDType.auto
    # vLLM engine settings under verl's keys (rollout.name=vllm; docs/rollout.md, "vLLM")
    enforce_eager: bool = False  # verl's default: CUDA graphs on GPUs (vLLM-CPU has none: always eager there)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    load_format: str = "dummy"  # dummy: random weights until the first sync (the trainer's, verified)
    engine_kwargs: EngineKwargsConfig = field(default_factory=EngineKwargsConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    server_urls: list[str] = field(default_factory=list)  # server mode: engines on other GPUs
    # server mode, rollout.name=hf, no server_urls: the run starts this many HF-engine servers (servers/hf_server.py)
    num_servers: int = 0
    server_threads: int = 1  # torch threads of each HF-engine server
    # trainer.launcher=ray: CPUs each started server's bundle reserves on the servers' own Ray resource pool
    # (rollout_servers, apart from the trainer's global_pool); null: server_threads
    server_cpus: Optional[float] = None
    # trainer.launcher=ray: started servers per Ray node, spread over ceil(num_servers / servers_per_node) different
    # nodes (the last takes the rest); null: all on one node
    servers_per_node: Optional[int] = None
    server_chunk_tokens: int = 8  # HF-engine server: tokens per decode call; a pause acts at a chunk boundary
    # HF-engine servers the run started: how many may die over the run and be replaced (0: the first fails the run)
    server_restarts: int = 0
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # MoE: the engine reports each token's top-k experts per layer (batch['routed_experts']) for router_replay R3
    enable_rollout_routing_replay: bool = False
