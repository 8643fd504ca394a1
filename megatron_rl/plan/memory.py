"""Memory per GPU of a Llama-family model under Megatron TP/PP/DP: the formulas, nothing else.

Everything is in bytes and counts one GPU of the busiest pipeline stage. Weights counted are the
linear layers and embeddings; norm weights and q/k/v biases (< 0.01% of a 7B+ model) are left out.
docs/launching.md derives each formula.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Optional

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


def attention_params(model: HFModelConfig) -> int:
    """q, k, v, o projections of one layer (the weight matrices; norms and biases: ``small_params``)."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    return h * (q + 2 * kv) + q * h


def small_params(model: HFModelConfig) -> int:
    """What the memory rows leave out (< 0.01 % of a real model): every RMSNorm weight and the q/k/v biases.
    ``total_params + small_params`` is the HF model's numel."""
    h = model.hidden_size
    per_layer = 2 * h + (model.q_size + 2 * model.kv_size if model.qkv_bias else 0)
    per_layer += 2 * model.head_dim if model.qk_norm else 0
    return model.num_layers * per_layer + h


def numel(model: HFModelConfig) -> int:
    """Every parameter of the HF causal LM, as ``sum(p.numel() for p in model.parameters())`` counts them."""
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


def _is_moe(model: HFModelConfig, layer: int) -> bool:
    return model.moe is not None and model.moe.is_moe_layer(layer)


def layer_params(model: HFModelConfig, layer: int = 0) -> int:
    """Weight matrices of transformer layer ``layer``: attention, and its dense MLP or its router, shared
    expert (with its gate) and all routed experts."""
    if _is_moe(model, layer):
        return attention_params(model) + moe_dense_params(model) + mlp_params(model)
    return attention_params(model) + dense_mlp_params(model)


def total_params(model: HFModelConfig) -> int:
    """The weight matrices of the HF model: embeddings, layers, lm_head unless tied (norms and biases:
    ``small_params``; ``numel`` counts both)."""
    vocab_matrices = 1 if model.tie_word_embeddings else 2
    layers = sum(layer_params(model, i) for i in range(model.num_layers))
    return layers + vocab_matrices * model.vocab_size * model.hidden_size


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
    for i in stage_layers(model, layout, stage):
        if _is_moe(model, i):
            layers += (attention_params(model) + moe_dense_params(model)) // layout.tp
            layers += mlp_params(model) // layout.expert_shards
        else:
            layers += layer_params(model, i) // layout.tp
    if layout.pp == 1:
        shared = model.tie_word_embeddings and lm_head
        return layers + vocab_shard * (1 if shared or not lm_head else 2)
    if stage == "first":
        return layers + vocab_shard
    return layers + (vocab_shard if lm_head else 0)


def stage_expert_params(model: HFModelConfig, layout: Layout, stage: Stage = "first") -> int:
    """Of ``stage_params``, the routed experts on one GPU of the first (default) or last stage (0 for a dense
    model)."""
    if model.moe is None:
        return 0
    moe_layers = sum(_is_moe(model, i) for i in stage_layers(model, layout, stage))
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

    Replicated over TP unless sequence parallel: the inputs and outputs of the two RMSNorms, 4 x h x 2 B.
    Split over TP: q, k, v and the attention output (2q + 2kv) x 2 B, the inputs of Qwen3's q/k norms (q + kv)
    x 2 B, and the MLP's (``mlp_activation_bytes_per_token``). ``dtype_bytes`` = 4 for an fp32 (CPU) run: the
    same tensors, twice the bytes. tests/plan/test_estimate_references.py holds it against Megatron-Core's
    theoretical-memory report and Korthikanti et al.'s per-layer formula (plan/accuracy.py).
    """
    replicated = 4 * model.hidden_size * dtype_bytes
    qk_norm = (model.q_size + model.kv_size) if model.qk_norm else 0
    attention = (2 * model.q_size + 2 * model.kv_size + qk_norm) * dtype_bytes
    mlp = sum(mlp_activation_bytes_per_token(model, layout, i, dtype_bytes) for i in range(model.num_layers))
    return (replicated / (layout.tp if layout.sequence_parallel else 1) + attention / layout.tp
            + mlp / model.num_layers)


def mlp_activation_bytes_per_token(model: HFModelConfig, layout: Layout, layer: int, dtype_bytes: int = BF16) -> float:
    """What a layer's MLP saves per token of the rank. Dense: the SwiGLU's gate, up and product, 3 x ffn x 2 B,
    split over TP. MoE (Megatron's token dispatcher): each token reaches top-k experts, so per token the rank holds
    top-k x ETP / TP (token, expert) pairs (with ETP = TP every rank of the TP group sees its group's pairs, each
    with a slice of the expert); each pair keeps the dispatched input and the expert's output (h x 2 B each, the
    latter for the gradient of its routing weight in the weighted combine) and the expert's gate, up and product
    (3 x ffn_e / ETP x 2 B); the router keeps its logits and scores over the experts in fp32; a shared expert is a
    dense SwiGLU of its size."""
    if not _is_moe(model, layer):
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
    kv_rank = max(1, model.num_key_value_heads // layout.tp)
    mask = rows * sequence_length * (-(-sequence_length // 16) * 16) * dtype_bytes
    copies = (q_rank - kv_rank) * model.head_dim * 2 * dtype_bytes * tokens
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


def rollout_weight_bytes(model: HFModelConfig, rollout_tp: int) -> float:
    """bf16 weights of one rollout engine rank: the engine shards every matrix over its TP ranks."""
    return total_params(model) * BF16 / rollout_tp


def kv_cache_bytes_per_token(model: HFModelConfig, rollout_tp: int) -> float:
    """K and V of every layer for one token on one engine rank; KV heads replicate when TP > KV heads."""
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


# ---------------------------------------------------------------------------- LoRA (issue 36)
# An MoE layer's targeted linear_fc1 / linear_fc2 puts an adapter on every routed expert's fc1 / fc2 (and on the
# shared expert's, if any); its attention is adapted as a dense layer's.
MLP_LINEARS = ("linear_fc1", "linear_fc2")
COLUMN_PARALLEL_LINEARS = ("linear_qkv", "linear_fc1")
TargetsOfLayer = Callable[[int], Iterable[str]]


def lora_linear_params(model: HFModelConfig, linear: str, rank: int, tp: int = 1,
                       ffn: Optional[int] = None) -> tuple[float, float]:
    """(A, B) parameters of the adapters on one Megatron linear of one layer, on one TP rank.

    linear_qkv: three adapters (q, k, v), each A [r, h] and B [part, r]; linear_fc1: two (gate, up), A [r, h],
    B [ffn, r]; linear_proj: A [r, q], B [h, r]; linear_fc2: A [r, ffn], B [h, r]. Sharded as the base
    linear: column-parallel (qkv, fc1) A replicated, B split over TP; row-parallel (proj, fc2) A split over TP,
    B replicated. ``ffn``: the MLP's width (default intermediate_size; an expert's, or the shared expert's),
    ``tp`` then the ranks it is split over (ETP for a routed expert)."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    ffn = model.intermediate_size if ffn is None else ffn
    if linear == "linear_qkv":
        return 3 * rank * h, (q + 2 * kv) * rank / tp
    if linear == "linear_fc1":
        return 2 * rank * h, 2 * ffn * rank / tp
    if linear == "linear_proj":
        return rank * q / tp, h * rank
    if linear == "linear_fc2":
        return rank * ffn / tp, h * rank
    raise ValueError(f"no LoRA adapter is built for {linear!r}")


def _is_expert_linear(model: HFModelConfig, layer: int, linear: str) -> bool:
    """Whether ``linear`` of ``layer`` is the MLP of an MoE layer: its adapters sit on the experts."""
    return linear in MLP_LINEARS and _is_moe(model, layer)


def lora_layer_params(model: HFModelConfig, layout: Layout, layer: int, linear: str, rank: int) -> tuple[float, float]:
    """(non-expert, routed-expert) adapter parameters of ``linear`` of global layer ``layer`` on one GPU.

    A dense layer's linears and every layer's attention: split over TP (lora_linear_params). An MoE layer's fc1 /
    fc2: the GPU's E / EP routed experts, each adapter of width moe_intermediate_size split over ETP, and the
    shared expert's (if any) split over TP like a dense MLP. The routed part is kept apart: its Adam state is
    sharded over the expert-DP group, not DP x CP."""
    if not _is_expert_linear(model, layer, linear):
        return sum(lora_linear_params(model, linear, rank, layout.tp)), 0.0
    moe = model.moe
    per_expert = sum(lora_linear_params(model, linear, rank, layout.expert_tp, moe.ffn_hidden_size))
    shared = sum(lora_linear_params(model, linear, rank, layout.tp, moe.shared_expert_size)) \
        if moe.shared_expert_size else 0.0
    return shared, moe.num_experts // layout.ep * per_expert


def _lora_stage_parts(model: HFModelConfig, layout: Layout, stage: Stage, rank: int,
                      targets_of_layer: TargetsOfLayer) -> list[tuple[float, float]]:
    """lora_layer_params of every targeted linear of the stage's layers."""
    return [lora_layer_params(model, layout, i, linear, rank)
            for i in stage_layers(model, layout, stage) for linear in targets_of_layer(i)]


def lora_stage_params(model: HFModelConfig, layout: Layout, stage: Stage, rank: int,
                      targets_of_layer: TargetsOfLayer) -> float:
    """Adapter parameters on one GPU of the first or last pipeline stage (routed experts' included);
    ``targets_of_layer(i)`` names the linears of global layer i that get adapters (config/lora.py lora_targets).
    With a one-GPU layout (TP = PP = EP = 1) the whole model's."""
    return sum(dense + experts for dense, experts in _lora_stage_parts(model, layout, stage, rank, targets_of_layer))


def lora_stage_expert_params(model: HFModelConfig, layout: Layout, stage: Stage, rank: int,
                             targets_of_layer: TargetsOfLayer) -> float:
    """Of ``lora_stage_params``, the routed experts' adapters (0 for a dense model)."""
    return sum(experts for _, experts in _lora_stage_parts(model, layout, stage, rank, targets_of_layer))


def lora_adapter_count(linear: str) -> int:
    """Adapters on one linear: q, k, v on linear_qkv; gate, up on linear_fc1; one on the others."""
    return {"linear_qkv": 3, "linear_fc1": 2}.get(linear, 1)


def lora_input_size(model: HFModelConfig, linear: str, tp: int = 1, ffn: Optional[int] = None) -> float:
    """The input width an adapter's A reads on one TP rank: the whole h for column-parallel linears (the
    sequence-parallel input is gathered), the rank's split of q or ffn (default intermediate_size) for
    row-parallel ones."""
    ffn = model.intermediate_size if ffn is None else ffn
    return {"linear_qkv": model.hidden_size, "linear_fc1": model.hidden_size,
            "linear_proj": model.q_size / tp, "linear_fc2": ffn / tp}[linear]


def _lora_linear_saved_bytes(model: HFModelConfig, linear: str, rank: int, dropout: float, tp: int, ax_split: int,
                             dtype_bytes: int, ffn: Optional[int] = None) -> float:
    """Per token (or routed pair), what one adapted linear saves: each adapter's A x ([r], / ``ax_split``), and
    with dropout > 0 its dropped-out input (width on the rank, ``dtype_bytes``) and the mask (1 B)."""
    saved = lora_adapter_count(linear) * rank * dtype_bytes / ax_split
    if dropout > 0:
        saved += lora_input_size(model, linear, tp, ffn) * (dtype_bytes + 1)
    return saved


def lora_expert_activation_bytes_per_token(model: HFModelConfig, layout: Layout, linear: str, rank: int,
                                           dropout: float, dtype_bytes: int = BF16) -> float:
    """What the routed experts' adapters on ``linear`` (fc1 or fc2) of one MoE layer save per token of the rank:
    per (token, expert) pair (routed_pairs_per_token, the count mlp_activation_bytes_per_token uses) A x (2 x r for
    fc1, r for fc2; not split), with dropout the input (h, or ffn_e / ETP) and its mask."""
    per_pair = _lora_linear_saved_bytes(model, linear, rank, dropout, layout.expert_tp, 1, dtype_bytes,
                                        model.moe.ffn_hidden_size)
    return routed_pairs_per_token(model, layout) * per_pair


def lora_activation_bytes_per_token_layer(model: HFModelConfig, layout: Layout, rank: int, dropout: float,
                                          linears: Iterable[str], dtype_bytes: int = BF16,
                                          sequence_parallel: bool = False, layer: Optional[int] = None) -> float:
    """What the LoRA path of one layer saves for backward per token, modelled simply: each adapter's A x
    ([tokens, r], which B's weight gradient reads; not split over TP: a row-parallel A's output is all-reduced,
    or reduce-scattered along the sequence under sequence parallelism), and with dropout > 0 each adapted
    linear's dropped-out input (its width on the rank, ``dtype_bytes``) and the mask (1 B). A's own input is the
    base linear's input, already counted by activation_bytes: under sequence parallelism a column-parallel adapter
    without dropout saves the rank's slice and gathers it again in the backward, as the base linear does
    (models/lora.py; tests/unit/test_lora_sp_memory.py measures it). ``layer`` (global index) given and an MoE
    layer: its fc1 / fc2 adapters are the routed experts' (lora_expert_activation_bytes_per_token) and the shared
    expert's (a dense MLP of its width), if any."""
    split = sequence_parallel and layout.tp > 1
    total = 0.0
    for linear in linears:
        ax_split = layout.tp if split and linear not in COLUMN_PARALLEL_LINEARS else 1
        if layer is None or not _is_expert_linear(model, layer, linear):
            total += _lora_linear_saved_bytes(model, linear, rank, dropout, layout.tp, ax_split, dtype_bytes)
            continue
        total += lora_expert_activation_bytes_per_token(model, layout, linear, rank, dropout, dtype_bytes)
        if model.moe.shared_expert_size:
            total += _lora_linear_saved_bytes(model, linear, rank, dropout, layout.tp, ax_split, dtype_bytes,
                                              model.moe.shared_expert_size)
    return total


def lora_activation_bytes(model: HFModelConfig, layout: Layout, tokens_per_micro_batch: int, micro_batches: int,
                          stage: Stage, per_token_layer: float, recompute: Recompute = Recompute()) -> float:
    """The LoRA path's saved tensors at the peak of a step, held like activation_bytes holds a layer's: every
    layer of the stage for each micro-batch in flight; under full recompute only the chunk being recomputed."""
    tokens = tokens_per_micro_batch / layout.cp
    layers = len(stage_layers(model, layout, stage))
    if recompute.granularity == "full":
        return min(recompute.num_layers, layers) * per_token_layer * tokens
    return layers * per_token_layer * tokens * micro_batches_in_flight(layout, micro_batches, stage)
