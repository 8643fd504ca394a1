"""Memory per GPU of a Llama-family model under Megatron TP/PP/DP: the formulas, nothing else.

Everything is in bytes and counts one GPU of the busiest pipeline stage. Weights counted are the
linear layers and embeddings; norm weights and q/k/v biases (< 0.01% of a 7B+ model) are left out.
docs/launching.md derives each formula.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal, Optional

import torch

from megatron_rl.models.attention import (
    FLASH_VARLEN,
    SDPA_EFFICIENT,
    SDPA_EFFICIENT_EXPANDED_KV,
    SDPA_MATH,
    padded_attention_plan,
)
from megatron_rl.models.sizes import padded_vocab_size, stage_layer_counts
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.mla import mla_attention_tensors
from megatron_rl.plan.vision import vision_params

BF16 = 2
FP32 = 4
Stage = Literal["first", "last"]


@dataclass(frozen=True)
class Layout:
    """One role's parallel layout: tensor, pipeline, virtual pipeline, context and data parallel sizes."""

    tp: int
    pp: int
    cp: int
    dp: int
    vpp: Optional[int] = None
    sequence_parallel: bool = False
    ep: int = 1  # MoE: experts split over EP ranks ...
    etp: Optional[int] = None  # ... and each expert over ETP ranks (None: = TP)
    # an uneven pipeline (override_transformer_config.num_layers_in_first/last_pipeline_stage; None: even)
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @property
    def expert_tp(self) -> int:
        """Ranks each expert is split over: ETP (= TP when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_shards(self) -> int:
        """Ranks one layer's experts are spread over: EP x ETP."""
        return self.ep * self.expert_tp


@dataclass(frozen=True)
class Recompute:
    """Megatron's activation recomputation: granularity None | "selective" | "full", method uniform | block."""

    granularity: Optional[str] = None
    method: str = "uniform"
    num_layers: int = 1


@dataclass(frozen=True)
class StateBytesPerParam:
    params: float
    grads: float
    optimizer: float
    # Of ``optimizer``, what exists right after the optimizer is built: the fp32 master weights. Adam's m
    # and v are allocated at its first step (or when a checkpoint is loaded), after the rollout engine has
    # sized itself on the memory then free.
    optimizer_at_start: float = 0.0


def _mla_shapes(model: HFModelConfig) -> list[tuple[int, ...]]:
    """Shapes of one layer's MLA tensors (the same in every layer), from models/mla.py's list."""
    return [shape for _, _, shape, _ in mla_attention_tensors(model.mla, 0, model.hidden_size,
                                                               model.num_attention_heads)]


def attention_params(model: HFModelConfig) -> int:
    """The weight matrices of one layer's attention (norms and biases: ``small_params``): GQA's q, k, v, o
    projections; MLA's q_a / q_b (or q_proj), kv_a_proj_with_mqa, kv_b_proj and o_proj (models/mla.py
    mla_attention_tensors). All split over TP but MLA's down projections (q_a, kv_a), which every TP rank holds
    whole (``attention_replicated_params``)."""
    if model.mla is not None:
        return sum(prod(shape) for shape in _mla_shapes(model) if len(shape) == 2)
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    return h * (q + 2 * kv) + q * h


def attention_replicated_params(model: HFModelConfig) -> int:
    """Of ``attention_params``, what every TP rank holds whole: MLA's q_a and kv_a down projections (TE's spec and
    the local one keep them whole: models/mla_layers.py); 0 for GQA."""
    if model.mla is None:
        return 0
    return sum(prod(shape) for _, _, shape, split in mla_attention_tensors(
        model.mla, 0, model.hidden_size, model.num_attention_heads) if split == "replicated" and len(shape) == 2)


def attention_small_params(model: HFModelConfig) -> int:
    """The vectors of one layer's attention: MLA's latent RMSNorms (q_a_layernorm, kv_a_layernorm, replicated
    over TP); GQA's q/k/v biases and Qwen3's q/k norms."""
    if model.mla is not None:
        return sum(prod(shape) for shape in _mla_shapes(model) if len(shape) == 1)
    biases = model.q_size + 2 * model.kv_size if model.qkv_bias else 0
    return biases + (2 * model.head_dim if model.qk_norm else 0)


def router_bias_params(model: HFModelConfig) -> int:
    """DeepSeek-V3's router bias (e_score_correction_bias), E per MoE layer: a buffer in transformers and in
    Megatron (Router.expert_bias: no gradient, no Adam state), but a tensor of the checkpoint."""
    if model.moe is None or not model.moe.expert_bias:
        return 0
    return model.moe.moe_layers(model.num_layers) * model.moe.num_experts


def small_params(model: HFModelConfig) -> int:
    """What the memory rows leave out (< 0.01 % of a real model): every RMSNorm weight, the q/k/v biases and
    the router bias. ``total_params + small_params`` is the HF model's numel."""
    h = model.hidden_size
    per_layer = 2 * h + attention_small_params(model)
    return model.num_layers * per_layer + h + router_bias_params(model)


def numel(model: HFModelConfig) -> int:
    """Every tensor element of the HF checkpoint: ``sum(p.numel() for p in model.parameters())`` of the causal
    LM, plus DeepSeek-V3's router bias (a buffer there: ``router_bias_params``)."""
    return total_params(model) + small_params(model)


def dense_mlp_params(model: HFModelConfig) -> int:
    """SwiGLU gate, up, down of a dense layer (a dense model's, or an MoE model's dense layers)."""
    return 3 * model.hidden_size * model.intermediate_size


def mlp_params(model: HFModelConfig, experts: int | None = None) -> int:
    """SwiGLU gate, up, down of one layer: the dense MLP, or ``experts`` (default all) routed experts of an
    MoE layer (without its router and shared expert: ``moe_dense_params``)."""
    if model.moe is None:
        return dense_mlp_params(model)
    count = model.moe.num_experts if experts is None else experts
    return count * 3 * model.hidden_size * model.moe.ffn_hidden_size


def moe_dense_params(model: HFModelConfig) -> int:
    """Of an MoE layer, what is not a routed expert: the router and the shared expert with its sigmoid gate
    (split over TP like the attention; the router and gate replicated, counted whole)."""
    moe, h = model.moe, model.hidden_size
    shared = 0
    if moe.shared_expert_size:
        shared = 3 * h * moe.shared_expert_size + (h if moe.shared_expert_gate else 0)
    return moe.num_experts * h + shared


def is_moe_layer(model: HFModelConfig, layer: int) -> bool:
    return model.moe is not None and model.moe.is_moe_layer(layer)


def layer_params(model: HFModelConfig, layer: int = 0) -> int:
    """Weight matrices of transformer layer ``layer``: attention, and its dense MLP or its router, shared
    expert (with its gate) and all routed experts."""
    if is_moe_layer(model, layer):
        return attention_params(model) + moe_dense_params(model) + mlp_params(model)
    return attention_params(model) + dense_mlp_params(model)


def mtp_layer_params(model: HFModelConfig) -> int:
    """Weight matrices of one multi-token-prediction layer the model builds (models/mtp.py): its projection
    [h, 2h] and its decoder layer (MoE as the model's last layer for DeepSeek-V3 / GLM-4.5); 0 without MTP."""
    if model.mtp is None:
        return 0
    decoder = layer_params(model, model.num_layers - 1) if model.mtp.moe_layer else (
        attention_params(model) + dense_mlp_params(model))
    return 2 * model.hidden_size * model.hidden_size + decoder


def total_params(model: HFModelConfig) -> int:
    """The weight matrices of the HF model: embeddings, layers, lm_head unless tied, the MTP layers it builds
    (norms and biases: ``small_params``; ``numel`` counts both)."""
    vocab_matrices = 1 if model.tie_word_embeddings else 2
    layers = sum(layer_params(model, i) for i in range(model.num_layers))
    mtp = model.mtp.num_layers * mtp_layer_params(model) if model.mtp is not None else 0
    # a vision-language model's vision tower, every tensor of it (plan/vision.py)
    return layers + vocab_matrices * model.vocab_size * model.hidden_size + mtp + vision_params(model.vision)


def mtp_stage_params(model: HFModelConfig, layout: Layout) -> int:
    """Of the last stage's parameters on one GPU, the MTP layers (models/mtp.py): the projection and decoder layer
    split over TP (routed experts over EP x ETP), and under PP > 1 Megatron's copy of the embedding there."""
    if model.mtp is None:
        return 0
    whole = attention_replicated_params(model)
    experts = mlp_params(model) if model.mtp.moe_layer else 0
    split = mtp_layer_params(model) - experts - whole
    per_layer = split // layout.tp + whole + experts // layout.expert_shards
    embedding = padded_vocab_size(model.vocab_size, layout.tp) * model.hidden_size // layout.tp if layout.pp > 1 else 0
    return model.mtp.num_layers * per_layer + embedding


def active_params(model: HFModelConfig) -> int:
    """Weights one token passes through: all of a dense model; of an MoE model's MoE layers only the top-k
    routed experts (the router and shared expert always run)."""
    if model.moe is None:
        return total_params(model)
    moe_layers = model.moe.moe_layers(model.num_layers)
    return total_params(model) - moe_layers * (mlp_params(model) - mlp_params(model, model.moe.topk))


def stage_layers(model: HFModelConfig, layout: Layout, stage: Stage) -> list[int]:
    """Global indices of the layers on the first or last pipeline stage, as Megatron cuts them: evenly over
    PP, or with the layout's first / last stage sizes and the rest evenly between (models/sizes.py
    stage_layer_counts); with a virtual pipeline (VPP) in PP x VPP chunks dealt round-robin, so the first stage
    holds chunks 0, PP, 2 PP, ... (with dense-first MoE models that decides how many experts a stage holds)."""
    if layout.first_stage_layers is not None or layout.last_stage_layers is not None:
        counts = stage_layer_counts(model.num_layers, layout.pp, layout.first_stage_layers, layout.last_stage_layers)
        return list(range(counts[0])) if stage == "first" else list(range(model.num_layers - counts[-1],
                                                                           model.num_layers))
    chunks = layout.pp * (layout.vpp or 1)
    per_chunk = model.num_layers // chunks
    rank = 0 if stage == "first" else layout.pp - 1
    return [layer for chunk in range(rank, chunks, layout.pp)
            for layer in range(chunk * per_chunk, (chunk + 1) * per_chunk)]


def stage_params(model: HFModelConfig, layout: Layout, stage: Stage, lm_head: bool = True) -> int:
    """Parameters on one GPU of the first or last pipeline stage.

    The stage's layers (``stage_layers``: evenly over PP, round-robin chunks under VPP), each with its own
    kind: an MoE model's dense layers (``mlp_only_layers``, ``decoder_sparse_step``) hold a dense MLP, its MoE
    layers a router, a shared expert if any, and the routed experts. Weights split over TP; routed experts
    over EP x ETP instead (dense MLPs and shared experts over TP). The (padded) embedding lives on the first
    stage and the output layer on the last; with PP=1 both are on the one stage, and tied embeddings
    share one matrix there. ``lm_head=False`` is the critic: a hidden -> 1 value head, no vocab output.
    """
    vocab_shard = padded_vocab_size(model.vocab_size, layout.tp) * model.hidden_size // layout.tp
    layers = 0
    whole = attention_replicated_params(model)  # MLA's down projections: on every TP rank
    for i in stage_layers(model, layout, stage):
        if is_moe_layer(model, i):
            layers += (attention_params(model) - whole + moe_dense_params(model)) // layout.tp + whole
            layers += mlp_params(model) // layout.expert_shards
        else:
            layers += (layer_params(model, i) - whole) // layout.tp + whole
    vision = stage_vision_params(model, layout, stage)
    if layout.pp == 1:
        shared = model.tie_word_embeddings and lm_head
        return layers + vocab_shard * (1 if shared or not lm_head else 2) + (mtp_stage_params(model, layout)
                                                                              if lm_head else 0) + vision
    if stage == "first":
        return layers + vocab_shard + vision
    return layers + (vocab_shard + mtp_stage_params(model, layout) if lm_head else 0)


def stage_vision_params(model: HFModelConfig, layout: Layout, stage: Stage) -> int:
    """Of ``stage_params``, a vision-language model's vision tower: whole on every TP rank of the first stage
    (models/vision_model.py), nothing elsewhere."""
    return vision_params(model.vision) if stage == "first" or layout.pp == 1 else 0


def stage_expert_params(model: HFModelConfig, layout: Layout, stage: Stage = "first") -> int:
    """Of ``stage_params``, the routed experts on one GPU of the first (default) or last stage (0 for a dense
    model)."""
    if model.moe is None:
        return 0
    moe_layers = sum(is_moe_layer(model, i) for i in stage_layers(model, layout, stage))
    return moe_layers * (mlp_params(model) // layout.expert_shards)


def expert_data_parallel(layout: Layout) -> int:
    """Ranks holding the same experts (Megatron's expert-DP group): a stage's ranks / (EP x ETP). The
    distributed optimizer shards the experts' Adam state over these, not over DP."""
    return layout.tp * layout.cp * layout.dp // layout.expert_shards


def state_bytes_per_param(params_dtype: str, distributed_optimizer: bool, optimizer_shards: int) -> StateBytesPerParam:
    """Bytes per parameter of a trained model with Adam.

    bf16 mixed precision: bf16 weights (2) + fp32 main grads (4) + fp32 master weights, Adam m and v (12).
    The distributed optimizer shards the 12 bytes over the data-parallel group (DP x CP ranks).
    fp32 training: fp32 weights (4) + fp32 grads (4) + Adam m, v (8); the weights are their own master.
    """
    if params_dtype in ("fp32", "float32"):
        param, optimizer, master = FP32, 2 * FP32, 0
    else:
        param, optimizer, master = BF16, 3 * FP32, FP32
    shards = optimizer_shards if distributed_optimizer else 1
    return StateBytesPerParam(params=param, grads=FP32, optimizer=optimizer / shards,
                              optimizer_at_start=master / shards)


def activation_bytes_per_token_layer(model: HFModelConfig, layout: Layout, dtype_bytes: int = BF16) -> float:
    """Bytes one layer saves for backward per token (bf16, flash attention, no dropout), the mean over the model's
    layers (an MoE model may have dense ones).

    Replicated over TP unless sequence parallel: the inputs and outputs of the two RMSNorms, 4 x h x 2 B (and
    MLA's latents). Split over TP: the attention's (``attention_activation_widths``) and the MLP's
    (``mlp_activation_bytes_per_token``). ``dtype_bytes`` = 4 for an fp32 (CPU) run: the same tensors, twice
    the bytes. tests/plan/test_estimate_references.py holds it against Megatron-Core's theoretical-memory
    report and Korthikanti et al.'s per-layer formula (plan/accuracy.py).
    """
    latents, split = attention_activation_widths(model)
    replicated = (4 * model.hidden_size + latents) * dtype_bytes
    attention = split * dtype_bytes
    mlp = sum(mlp_activation_bytes_per_token(model, layout, i, dtype_bytes) for i in range(model.num_layers))
    return (replicated / (layout.tp if layout.sequence_parallel else 1) + attention / layout.tp
            + mlp / model.num_layers)


def attention_activation_widths(model: HFModelConfig) -> tuple[int, int]:
    """(replicated, split over TP) elements one layer's attention saves for backward per token, beyond the
    layer's two RMSNorms (flash attention: its fp32 log-sum-exp left out; the kernel's extras:
    ``attention_kernel_bytes``).

    GQA: (0, 2q + 2kv + (q + kv if qk_norm)): q, k, v, the core attention's output, and the inputs of
    Qwen3's q/k norms, all split over TP.
    MLA (Megatron-Core's MLASelfAttention, unfused RoPE): split over TP by head, the core attention's
    contiguous q and k of nope + rope dims, v and the output of v_head_dim: heads x (2 (nope + rope) + 2 v).
    Replicated (Megatron gathers the down projections' TP-split outputs whole, and scatters them along the
    sequence again under sequence parallelism: split like the layer norms'), the q and kv latents, each its
    RMSNorm's input and output (the up projection's input): 2 q_lora_rank + 2 kv_lora_rank + qk_rope_head_dim
    (the kv norm's input is a view of kv_a_proj_with_mqa's output, which keeps its rope columns alive; no q
    latent without q_lora_rank: q_proj reads the layer norm's output). Left out: RoPE's cos / sin for q and k
    (4 x qk_rope_head_dim a token: 0.2 % of DeepSeek-V3's layer at TP 1); the rotated parts are concatenated into the new q
    and k and the up projections' outputs only split and copied, so neither is kept.
    tests/plan/test_mla_plan.py matches autograd's saved tensors byte for byte with the omissions named."""
    if model.mla is None:
        qk_norm = (model.q_size + model.kv_size) if model.qk_norm else 0
        return 0, 2 * model.q_size + 2 * model.kv_size + qk_norm
    mla = model.mla
    latents = 2 * (mla.q_lora_rank or 0) + 2 * mla.kv_lora_rank + mla.qk_rope_head_dim
    return latents, model.num_attention_heads * (2 * mla.q_head_dim + 2 * mla.v_head_dim)


def core_attention_heads(model: HFModelConfig) -> tuple[int, int]:
    """(K/V heads, q/k head dim) of the core attention: GQA's KV heads of head_dim; MLA expands its k and v to
    every query head, of nope + rope dims (v's head dim, v_head_dim, is the output's)."""
    if model.mla is not None:
        return model.num_attention_heads, model.mla.q_head_dim
    return model.num_key_value_heads, model.head_dim


def mlp_activation_bytes_per_token(model: HFModelConfig, layout: Layout, layer: int, dtype_bytes: int = BF16) -> float:
    """What a layer's MLP saves per token of the rank. Dense: the SwiGLU's gate, up and product, 3 x ffn x 2 B,
    split over TP. MoE (Megatron's token dispatcher): each token reaches top-k experts, so per token the rank holds
    top-k x ETP / TP (token, expert) pairs (with ETP = TP every rank of the TP group sees its group's pairs, each
    with a slice of the expert); each pair keeps the dispatched input and the expert's output (h x 2 B each, the
    latter for the gradient of its routing weight in the weighted combine) and the expert's gate, up and product
    (3 x ffn_e / ETP x 2 B); the router keeps its logits and scores over the experts in fp32; a shared expert is a
    dense SwiGLU of its size."""
    if not is_moe_layer(model, layer):
        ffn = model.intermediate_size if model.moe is None else (model.moe.dense_ffn_hidden_size
                                                                 or model.intermediate_size)
        return 3 * ffn * dtype_bytes / layout.tp
    moe, h = model.moe, model.hidden_size
    etp = layout.expert_tp
    experts = routed_pairs_per_token(model, layout) * (2 * h + 3 * moe.ffn_hidden_size / etp) * dtype_bytes
    router = 2 * moe.num_experts * FP32 / (layout.tp if layout.sequence_parallel else 1)
    shared = 3 * (moe.shared_expert_size or 0) * dtype_bytes / layout.tp
    return experts + router + shared


def routed_pairs_per_token(model: HFModelConfig, layout: Layout) -> float:
    """(token, expert) pairs an MoE layer's experts on one rank process per token of the rank: top-k x ETP / TP
    (with ETP = TP every rank of the TP group sees its group's pairs, each with a slice of the expert)."""
    return model.moe.topk * layout.expert_tp / layout.tp


# ---------------------------------------------------------------------------- context parallelism (issue 35)
# CP splits every sequence of a packed (THD) micro-batch into 2 x CP chunks; rank r holds chunks r and
# 2CP-1-r (the load-balanced "dual chunk swap" Megatron and Transformer Engine expect). A sequence is padded
# at its end to a multiple of 2 x CP (x TP under sequence parallelism, whose scatter splits each rank's
# tokens over TP again), so every rank holds ceil(len / (2 CP m)) x 2m of its tokens.
TE_CP_P2P = "te_cp_p2p"  # TE ring: K/V chunks passed round the CP ranks, partial outputs merged
TE_CP_A2A = "te_cp_a2a"  # TE all-to-all (Ulysses): sequence-split -> head-split for the attention, and back
TE_CP_ALL_GATHER = "te_cp_all_gather"  # TE all-gather of K/V (TE 2.11: not for THD, so not with packing)
SDPA_CP_ALL_GATHER = "sdpa_cp_all_gather"  # our SDPAttention on CPU / without TE: K/V gathered over CP


def cp_split_multiple(layout: Layout) -> int:
    """What each sequence is padded to a multiple of at CP > 1: 2 x CP, times TP under sequence parallelism
    (1 at CP = 1: nothing is padded)."""
    if layout.cp == 1:
        return 1
    return 2 * layout.cp * (layout.tp if layout.sequence_parallel else 1)


def cp_padded_length(length: int, layout: Layout) -> int:
    """One sequence's length after the CP split's padding (its own length at CP = 1)."""
    multiple = cp_split_multiple(layout)
    return -(-int(length) // multiple) * multiple


def cp_rank_tokens(lengths, layout: Layout) -> int:
    """Tokens one CP rank holds of a packed micro-batch of sequences of ``lengths``: each sequence padded
    to a multiple of 2 CP m (m = TP under sequence parallelism, else 1), of which the rank holds 2 of the
    2 CP chunks = sum(ceil(len / (2 CP m)) x 2m). At CP = 1 the sum of the lengths."""
    return sum(cp_padded_length(n, layout) for n in lengths) // layout.cp


def cp_attention_kernel(cp: int, cp_comm_type: Optional[str], transformer_engine: bool = True) -> Optional[str]:
    """The context-parallel attention a CP > 1 micro-batch runs: Transformer Engine's, with the
    ``cp_comm_type`` the TransformerConfig gets (null: p2p, what Megatron's TEDotProductAttention passes),
    on a CUDA run with TE; SDPAttention's all-gather of K/V otherwise (CPU, or CUDA without TE). None at CP = 1."""
    if cp == 1:
        return None
    if not transformer_engine:
        return SDPA_CP_ALL_GATHER
    return {"p2p": TE_CP_P2P, None: TE_CP_P2P, "a2a": TE_CP_A2A, "all_gather": TE_CP_ALL_GATHER}[cp_comm_type]


def cp_attention_bytes(kernel: Optional[str], model: HFModelConfig, layout: Layout, tokens_per_micro_batch: int,
                       micro_batches: int, stage: Stage, recompute: Recompute = Recompute(),
                       dtype_bytes: int = BF16) -> tuple[float, float]:
    """(stored, transient) bytes the CP attention adds to activation_bytes' per-rank q, k, v and output,
    for a micro-batch of ``tokens_per_micro_batch`` (padded, all CP ranks together: T).

    Stored (kept for backward, per layer and micro-batch in flight):
    - ``sdpa_cp_all_gather``: SDPA keeps the K and V it attended to, the whole micro-batch's (T tokens)
      where the local share (T / CP) is already counted: (T - T / CP) x 2 kv / TP x 2 B per layer.
    - ``te_cp_a2a``: TE saves the attention output in the head-split layout, a tensor apart from the
      sequence-split output the output projection keeps: T / CP x q / TP x 2 B per layer.
    - ``te_cp_p2p``, ``te_cp_all_gather``: q, k, v and the output of the rank's own tokens (and the
      fp32 log-sum-exp, left out as for flash): nothing beyond activation_bytes.
    Transient (one layer at a time, counted once):
    - ``te_cp_p2p`` (TE 2.11 forward): every K/V chunk received round the ring stays referenced until the
      layer's attention returns, i.e. the whole micro-batch's K and V (T x 2 kv / TP x 2 B), plus the
      output of each of the CP steps (T x q / TP x 2 B) and the merged output (T / CP x q / TP x 2 B).
    - ``te_cp_all_gather``, ``sdpa_cp_all_gather``: the gathered K and V, and in backward their
      gradients: 2 x T x 2 kv / TP x 2 B.
    - ``te_cp_a2a``: a second copy of the rank's q, k, v and output in the head-split layout:
      T / CP x (2 q + 2 kv) / TP x 2 B.
    Selective recompute re-runs the core attention: nothing of it is stored. Full recompute stores it only
    for the chunk being recomputed.
    """
    if kernel is None or layout.cp == 1:
        return 0.0, 0.0
    tokens = float(tokens_per_micro_batch)
    local = tokens / layout.cp
    q_rank = model.q_size / layout.tp
    kv_rank = max(1, model.num_key_value_heads // layout.tp) * model.head_dim
    if kernel == SDPA_CP_ALL_GATHER:
        per_layer = (tokens - local) * 2 * kv_rank * dtype_bytes
        transient = 2 * tokens * 2 * kv_rank * dtype_bytes
    elif kernel == TE_CP_A2A:
        per_layer = local * q_rank * dtype_bytes
        transient = local * (2 * q_rank + 2 * kv_rank) * dtype_bytes
    elif kernel == TE_CP_P2P:
        per_layer = 0.0
        transient = (tokens * 2 * kv_rank + tokens * q_rank + local * q_rank) * dtype_bytes
    elif kernel == TE_CP_ALL_GATHER:
        per_layer = 0.0
        transient = 2 * tokens * 2 * kv_rank * dtype_bytes
    else:
        raise ValueError(f"unknown context-parallel attention kernel {kernel!r}")
    if recompute.granularity == "selective":
        return 0.0, transient
    layers = len(stage_layers(model, layout, stage))
    if recompute.granularity == "full":
        return min(recompute.num_layers, layers) * per_layer, transient
    return layers * per_layer * micro_batches_in_flight(layout, micro_batches, stage), transient


def micro_batch_activation_bytes(model: HFModelConfig, layout: Layout, lengths, *, micro_batches: int = 1,
                                 stage: Stage = "first", recompute: Recompute = Recompute(),
                                 cp_kernel: Optional[str] = None, dtype_bytes: int = BF16,
                                 logits: bool = True) -> float:
    """The planner's activation estimate for one rank of a packed micro-batch of sequences of ``lengths``
    (tokens each, before the CP split): what ``_trained_role_rows`` adds up for the update phase.

    Tokens per rank come from the real split (cp_rank_tokens: each sequence padded to 2 CP m); per layer
    activation_bytes_per_token_layer of them; the logits of the rank's own tokens (``logits``: the actor,
    at the last or only stage); and the CP attention's stored and transient bytes (cp_attention_bytes;
    ``cp_kernel`` None: the kernel a CUDA run with TE picks for p2p at CP > 1, SDPA_CP_ALL_GATHER for
    SDPAttention's). ``dtype_bytes`` = 4 scales the same formula to an fp32 (CPU) run.
    """
    tokens = cp_rank_tokens(lengths, layout) * layout.cp  # padded, all CP ranks together
    total = activation_bytes(model, layout, tokens, micro_batches, stage, recompute, dtype_bytes=dtype_bytes)
    if logits and (stage == "last" or layout.pp == 1):
        total += logits_bytes(model, layout, tokens, dtype_bytes=dtype_bytes)
    kernel = cp_kernel if cp_kernel is not None else cp_attention_kernel(layout.cp, None)
    stored, transient = cp_attention_bytes(kernel, model, layout, tokens, micro_batches, stage, recompute,
                                           dtype_bytes)
    return total + stored + transient


def micro_batches_in_flight(layout: Layout, micro_batches: int, stage: Stage) -> float:
    """Micro-batches whose activations a stage holds at once under 1F1B.

    The first stage holds PP of them (PP + (PP-1)/VPP with the interleaved schedule), the last stage
    one; never more than the micro-batches there are.
    """
    if stage == "last" or layout.pp == 1:
        return 1
    in_flight = layout.pp + ((layout.pp - 1) / layout.vpp if layout.vpp else 0)
    return min(micro_batches, in_flight)


def activation_bytes(model: HFModelConfig, layout: Layout, tokens_per_micro_batch: int, micro_batches: int,
                     stage: Stage, recompute: Recompute = Recompute(), dtype_bytes: int = BF16) -> float:
    """Activations a GPU of ``stage`` holds at the peak of a training step.

    Without recompute each of the stage's L/PP layers keeps its full activations. Full recompute keeps
    only the checkpointed layer inputs (h x 2 B per token, split by TP under sequence parallel) plus one
    recompute chunk of full activations while it is recomputed. Selective recompute re-runs the core
    attention only, whose s x s scores flash attention never stores: it saves nothing here.
    At CP > 1 ``tokens_per_micro_batch`` is the micro-batch after the CP split's padding (cp_padded_length
    of each sequence): each rank holds 1 / CP of it.
    """
    tokens = tokens_per_micro_batch / layout.cp
    per_layer = activation_bytes_per_token_layer(model, layout, dtype_bytes) * tokens
    layers = len(stage_layers(model, layout, stage))
    if recompute.granularity == "full":
        checkpoint = model.hidden_size * dtype_bytes * tokens / (layout.tp if layout.sequence_parallel else 1)
        chunk = min(recompute.num_layers, layers)
        if recompute.method == "block":  # the first `chunk` layers recompute, the others keep everything
            stored = chunk * checkpoint + (layers - chunk) * per_layer
        else:  # uniform: a checkpoint per chunk of `chunk` layers
            stored = -(-layers // chunk) * checkpoint
        return stored * micro_batches_in_flight(layout, micro_batches, stage) + chunk * per_layer
    return layers * per_layer * micro_batches_in_flight(layout, micro_batches, stage)


def attention_kernel(*, packed: bool, shared_prompts: bool, dtype: str, dropout: float, q_heads: int,
                     kv_heads: int, head_dim: int, tp: int, window: bool = False) -> str:
    """The attention kernel a training micro-batch runs on a CUDA GPU, decided as models/attention.py does.

    Packed sequences (THD) in half precision without dropout: torch's varlen flash. Otherwise SDPA with
    ``padded_attention_plan``: padded rows (and shared prompts) always carry a mask, so flash is out and
    mem-efficient runs, on K/V repeated to the query heads for a GQA model.
    """
    torch_dtype = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
                   "float16": torch.float16}.get(dtype, torch.bfloat16)
    q_rank, kv_rank = q_heads // tp, max(1, kv_heads // tp)  # K/V heads replicate when TP > their number
    masked = True
    if packed and not shared_prompts:
        if torch_dtype in (torch.float16, torch.bfloat16) and dropout == 0.0:
            return FLASH_VARLEN
        masked = window  # the per-sequence twin: is_causal, a mask only for a sliding window
    return padded_attention_plan(on_cuda=True, dtype=torch_dtype, q_heads=q_rank, kv_heads=kv_rank,
                                 head_dim=head_dim, masked=masked).kernel


def attention_kernel_bytes(kernel: str, model: HFModelConfig, layout: Layout, tokens_per_micro_batch: int,
                           sequence_length: int, micro_batches: int, stage: Stage,
                           recompute: Recompute = Recompute(), dtype_bytes: int = BF16) -> float:
    """What the attention kernel keeps for backward beyond activation_bytes' q, k, v and output (which
    assume flash: only a [heads, tokens] fp32 log-sum-exp, left out).

    mem-efficient keeps the mask it was given, converted to the query's dtype with its key dim padded to a
    multiple of 16, once per layer ([rows, s, s16] x 2 B); with GQA also the K/V copies repeated to the
    query heads ((q - kv) heads x d x 2 tensors x 2 B per token). The math kernel keeps fp32 [heads, s, s]
    softmax probabilities per layer (4 B), the K/V it repeats for enable_gqa and the mask too.
    Selective recompute re-runs the core attention: nothing of it is kept. Full recompute keeps it only
    for the chunk being recomputed.
    """
    if kernel not in (SDPA_EFFICIENT, SDPA_EFFICIENT_EXPANDED_KV, SDPA_MATH):
        return 0.0
    if recompute.granularity == "selective":
        return 0.0
    tokens = tokens_per_micro_batch / layout.cp
    rows = max(tokens / sequence_length, 1.0)
    q_rank = model.num_attention_heads // layout.tp
    kv_heads, head_dim = core_attention_heads(model)
    kv_rank = max(1, kv_heads // layout.tp)
    mask = rows * sequence_length * (-(-sequence_length // 16) * 16) * dtype_bytes
    copies = (q_rank - kv_rank) * head_dim * 2 * dtype_bytes * tokens
    per_layer = mask
    if kernel == SDPA_EFFICIENT_EXPANDED_KV:
        per_layer += copies
    elif kernel == SDPA_MATH:
        per_layer += copies + q_rank * rows * sequence_length * sequence_length * FP32
    layers = len(stage_layers(model, layout, stage))
    if recompute.granularity == "full":
        return min(recompute.num_layers, layers) * per_layer
    return layers * per_layer * micro_batches_in_flight(layout, micro_batches, stage)


def logits_bytes(model: HFModelConfig, layout: Layout, tokens_per_micro_batch: int, dtype_bytes: int = BF16) -> float:
    """The last stage's output: bf16 logits plus an fp32 copy for the log-softmax, vocab split by TP; at
    CP > 1 only the rank's own T / CP tokens' logits (an fp32 run: fp32 logits, and the fp32 copy)."""
    vocab = padded_vocab_size(model.vocab_size, layout.tp) / layout.tp
    return tokens_per_micro_batch / layout.cp * vocab * (dtype_bytes + FP32)


def mtp_activation_bytes(model: HFModelConfig, layout: Layout, tokens_per_micro_batch: int,
                         dtype_bytes: int = BF16) -> float:
    """What the MTP layers add to the last stage's activations when they train (model.mtp.enable_train), per
    depth: the concatenated [embedding | hidden] input (2h), one decoder layer's activations and its logits."""
    if model.mtp is None:
        return 0.0
    tokens = tokens_per_micro_batch / layout.cp
    concat = 2 * model.hidden_size * dtype_bytes / (layout.tp if layout.sequence_parallel else 1)
    per_depth = tokens * (concat + activation_bytes_per_token_layer(model, layout, dtype_bytes))
    return model.mtp.num_layers * (per_depth + logits_bytes(model, layout, tokens_per_micro_batch, dtype_bytes))


def rollout_weight_bytes(model: HFModelConfig, rollout_tp: int, drafts: bool = False) -> float:
    """bf16 weights of one rollout engine rank: the engine shards every matrix over its TP ranks; the MTP layers
    only when it drafts with them (``drafts``: model.mtp.enable_rollout), else they stay with the trainer."""
    mtp = model.mtp.num_layers * mtp_layer_params(model) if model.mtp is not None and not drafts else 0
    return (total_params(model) - mtp) * BF16 / rollout_tp


def kv_cache_bytes_per_token(model: HFModelConfig, rollout_tp: int) -> float:
    """K and V of every layer for one token on one engine rank; KV heads replicate when TP > KV heads.

    MLA: the engines cache the compressed latent, kv_lora_rank + qk_rope_head_dim per layer and token (one
    "KV head", no separate V), whole on every TP rank: vLLM 0.32 vllm/model_executor/layers/attention/
    mla_attention.py (``head_size = kv_lora_rank + qk_rope_head_dim``; get_kv_cache_spec: num_kv_heads=1) and
    vllm/v1/kv_cache_interface.py (MLAAttentionSpec: "MLA stores a single latent vector per state; there is no
    separate V")."""
    if model.mla is not None:
        return model.num_layers * (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * BF16
    kv_heads_per_rank = -(-model.num_key_value_heads // rollout_tp)
    return 2 * model.num_layers * kv_heads_per_rank * model.head_dim * BF16


def checkpoint_save_host_bytes(params: int, params_dtype: str, distributed_optimizer: bool, optimizer_shards: int,
                               sharding_type: str) -> float:
    """Host RAM one rank holds for the Adam state while a checkpoint is saved (workers/checkpoint.py).

    ``params`` is the rank's model-parallel share (its TP x PP slice). The optimizer state is fp32 master
    weights, m and v (12 bytes a parameter; 8 in fp32 training). With the distributed optimizer,
    megatron-core 0.16.1's ``fully_reshardable`` all-gathers the whole DP group's state into every rank's
    host RAM (``get_parameter_state_dp_zero(return_on_all_ranks=True)``); ``fully_sharded_model_space``
    (what saves use now) holds only the rank's own shard, 1/``optimizer_shards`` of it. Without the
    distributed optimizer every rank already holds the full state and nothing is gathered.
    """
    if params_dtype in ("fp32", "float32"):
        per_param = 2 * FP32
    else:
        per_param = 3 * FP32
    full = params * per_param
    if distributed_optimizer and sharding_type != "fully_reshardable":
        return full / optimizer_shards
    return full
