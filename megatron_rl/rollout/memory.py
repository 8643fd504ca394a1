"""Each rollout engine's own meaning of its memory knob (``rollout.gpu_memory_utilization``), per GPU.

The same number means different things to different engines: SGLang's ``mem_fraction_static`` is a fraction
of the memory free when the engine starts, vLLM's ``gpu_memory_utilization`` a fraction of the GPU's total,
which vLLM refuses to start with when less than that is free. Each engine's ``EngineSpec`` (rollout/engines.py)
names its model; the planner (plan/planner.py) and the launch check read nothing else about the knob.

All figures are bytes on one GPU. What both engines' processes hold outside the knob and keep while asleep
(their CUDA context and NCCL buffers, created before either engine measures free memory) is part of
``plan.reserved_gib``, with the trainer's own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from megatron_rl.models.hf_config import HFModelConfig

GIB = 2**30
KNOB = "actor_rollout_ref.rollout.gpu_memory_utilization"
FP32 = 4

# vLLM captures CUDA graphs unless enforce_eager. Our engine does not set sleep_mode_offload_cudagraph, so the
# graphs are captured outside the cuMem pool (vllm/compilation/cudagraph_pool.py:38, config/vllm.py:688) and
# stay on the GPU while the engine sleeps (sleep releases only the cuMem pool's allocations,
# vllm/device_allocator/sleep_mode_backend.py:127-137). vLLM counts them inside its budget
# (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 by default, vllm/envs.py:328; gpu_worker.py:741). An allowance:
# the figure a real start measures is in vLLM's log ("CUDA graph memory profiling ... ").
VLLM_CUDA_GRAPH_BYTES = 1 * GIB


@dataclass(frozen=True)
class EngineStart:
    """One GPU when the engine starts: what the engine's knob is read against."""

    total: float  # the GPU's memory (plan.gpu_memory_gib)
    held: float  # what is already in use then: the trainer's state and plan.reserved_gib (0: its own GPU)
    weights: float  # the engine's weights on this GPU
    fraction: float  # rollout.gpu_memory_utilization
    model: HFModelConfig
    tp: int  # rollout.tensor_model_parallel_size
    max_num_seqs: int  # rollout.max_num_seqs, max_num_batched_tokens, enforce_eager: vLLM's batch and graphs
    max_num_batched_tokens: int
    enforce_eager: bool

    @property
    def free(self) -> float:
        return max(self.total - self.held, 0.0)


@dataclass(frozen=True)
class EngineMemory:
    """What an engine takes on one GPU under its own meaning of the knob."""

    engine: str
    meaning: str  # how the engine reads the knob, for the plan's text
    start: EngineStart
    base: float  # the bytes the knob is a fraction of ...
    base_label: str  # ... and what they are ("total", "free at engine start")
    budget: float  # what the knob grants: weights + KV cache (+ vLLM's activations and CUDA graphs)
    kv_cache: float
    asleep: float  # what the engine keeps on the GPU while asleep, beyond plan.reserved_gib
    refusal: Optional[str] = None  # why the engine would refuse to start, in its own words and ours


def sglang_memory(start: EngineStart) -> EngineMemory:
    """SGLang 0.5.23's mem_fraction_static: of the memory free when the engine starts (measured after its
    distributed init, before its weights), the fraction for weights and KV cache (model_runner:
    ``rest_memory = available - total x (1 - fraction)``, total = that free memory). Its activations and
    CUDA graphs live in the rest; release_memory_occupation gives back weights, KV cache and CUDA graphs
    (rollout/sglang/contract.py, memory_tags), so a sleeping engine keeps only its context and NCCL.
    Expert parallelism (engine_kwargs.sglang.ep_size) leaves ``start.weights`` as it is: SGLang splits the
    engine's tp_size ranks into ep_size groups of tp_size // ep_size ranks (srt/runtime_context.py: moe_tp_size),
    so each GPU holds 1/ep_size of the experts, each sharded 1/moe_tp_size: 1/tp_size of them, as without EP."""
    budget = start.fraction * start.free
    return EngineMemory("sglang", "mem_fraction_static, a fraction of the memory free at engine start", start,
                        base=start.free, base_label="free at engine start", budget=budget,
                        kv_cache=budget - start.weights, asleep=0.0)


def hf_memory(start: EngineStart) -> EngineMemory:
    """The HF engine has no memory knob: it runs in the trainer's process and grows its KV cache with the
    batch. The plan keeps the knob's fraction of the free memory for its weights and KV cache, as SGLang's;
    its sleep moves the weights to host memory and empties the cache (rollout/hf_engine.py)."""
    return replace(sglang_memory(start), engine="hf",
                   meaning="a planning share of the memory free at engine start (no knob of its own)")


def vllm_memory(start: EngineStart) -> EngineMemory:
    """vLLM 0.32's gpu_memory_utilization: a fraction of the GPU's TOTAL memory for the whole engine.

    At start it asks for ``ceil(total x fraction)`` and refuses when less is free
    (vllm/v1/worker/utils.py:724 and :761, called from gpu_worker.py init_device, :535); the KV cache is that
    budget minus what its profile run measured: weights, activation peak and CUDA graphs
    (gpu_worker.py:741, ``requested_memory - non_kv_cache_memory - cudagraph_memory_estimate``). Sleep level
    2 releases weights and KV cache; the CUDA graphs stay (VLLM_CUDA_GRAPH_BYTES)."""
    requested = math.ceil(start.total * start.fraction)
    activations = vllm_activation_bytes(start)
    graphs = 0.0 if start.enforce_eager else VLLM_CUDA_GRAPH_BYTES
    refusal = None
    if start.free < requested:
        # vLLM's words (utils.py:764-770), then what to set
        ceiling = math.floor(start.free / start.total * 100) / 100
        refusal = (f"{KNOB}={start.fraction:g} with rollout.name=vllm asks for {start.fraction:g} x the GPU's "
                   f"{_gib(start.total)} GiB total = {_gib(requested)} GiB, but only {_gib(start.free)} GiB will be "
                   f"free when the engine starts ({_gib(start.held)} GiB held by the trainer and plan.reserved_gib "
                   f"then). vLLM refuses to start: 'Free memory on device ({_gib(start.free)}/{_gib(start.total)} "
                   f"GiB) on startup is less than desired GPU memory utilization ({start.fraction:g}, "
                   f"{_gib(requested)} GiB)'. vLLM reads the knob as a fraction of the total (SGLang: of the free "
                   f"memory): set {KNOB} <= {ceiling:.2f}")
    return EngineMemory("vllm", "gpu_memory_utilization, a fraction of the GPU's total memory", start,
                        base=start.total, base_label="total", budget=float(requested),
                        kv_cache=requested - start.weights - activations - graphs, asleep=graphs, refusal=refusal)


def vllm_activation_bytes(start: EngineStart, dtype_bytes: int = 2) -> float:
    """vLLM's profiled activation peak on one rank, modelled: its profile run passes max_num_batched_tokens
    through the model (one layer's widest tensors at once: q, k, v and the SwiGLU gate and up, split over TP,
    plus the residual) and samples min(max_num_seqs, max_num_batched_tokens) rows, whose fp32 logits over the
    whole vocabulary the sampler holds twice (logits and the sorted copy of top-p/top-k)
    (vllm/v1/worker/gpu_model_runner.py, profile_run and _dummy_sampler_run)."""
    model = start.model
    per_token = ((_qkv_width(model) + 2 * model.intermediate_size) / start.tp
                 + 2 * model.hidden_size) * dtype_bytes
    rows = min(start.max_num_seqs, start.max_num_batched_tokens)
    return start.max_num_batched_tokens * per_token + 2 * rows * model.vocab_size * FP32


def _qkv_width(model: HFModelConfig) -> int:
    """q, k and v of one token, all heads: GQA's q + 2 kv; MLA's per-head q and k of qk_nope + qk_rope dims
    and v of v_head_dim (vLLM's prefill up-projects them; its KV cache keeps only the latent: plan/memory.py
    kv_cache_bytes_per_token)."""
    if model.mla is None:
        return model.q_size + 2 * model.kv_size
    return model.num_attention_heads * (2 * model.mla.q_head_dim + model.mla.v_head_dim)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"
