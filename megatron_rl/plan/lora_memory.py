"""LoRA in the memory model (issues 36 and 51): the adapters' parameters per targeted linear, layer and GPU (an MoE
layer's on every routed expert and the shared expert) and what their path saves for backward. The base model's
terms are plan/memory.py's; docs/launching.md, 'LoRA', derives each formula."""
from __future__ import annotations

from typing import Callable, Iterable, Optional

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.plan.memory import (
    BF16,
    Layout,
    Recompute,
    Stage,
    is_moe_layer,
    micro_batches_in_flight,
    routed_pairs_per_token,
    stage_layers,
)

# An MoE layer's targeted linear_fc1 / linear_fc2 puts an adapter on every routed expert's fc1 / fc2 (and on the
# shared expert's, if any); its attention is adapted as a dense layer's.
MLP_LINEARS = ("linear_fc1", "linear_fc2")
COLUMN_PARALLEL_LINEARS = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
# multi-latent attention's down projections: whole on every TP rank, their adapters too (A and B replicated; under
# sequence parallelism the rank's slice of the sequence, as a row-parallel adapter's A x)
DUPLICATED_LINEARS = ("linear_q_down_proj", "linear_kv_down_proj")
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
    mla = getattr(model, "mla", None)
    if mla is not None and linear not in MLP_LINEARS:
        return _mla_linear_params(model, linear, rank, tp)
    if linear == "linear_qkv":
        return 3 * rank * h, (q + 2 * kv) * rank / tp
    if linear == "linear_fc1":
        return 2 * rank * h, 2 * ffn * rank / tp
    if linear == "linear_proj":
        return rank * q / tp, h * rank
    if linear == "linear_fc2":
        return rank * ffn / tp, h * rank
    raise ValueError(f"no LoRA adapter is built for {linear!r}")


def _mla_sizes(model: HFModelConfig, linear: str) -> tuple[int, int]:
    """(input, output) width of a multi-latent attention linear (models/mla.py ``mla_attention_tensors``)."""
    mla, h, heads = model.mla, model.hidden_size, model.num_attention_heads
    q_rows = heads * mla.q_head_dim
    sizes = {"linear_q_proj": (h, q_rows), "linear_kv_down_proj": (h, mla.kv_lora_rank + mla.qk_rope_head_dim),
             "linear_kv_up_proj": (mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
             "linear_proj": (heads * mla.v_head_dim, h)}
    if mla.q_lora_rank is not None:
        sizes |= {"linear_q_down_proj": (h, mla.q_lora_rank), "linear_q_up_proj": (mla.q_lora_rank, q_rows)}
    if linear not in sizes:
        raise ValueError(f"no LoRA adapter is built for {linear!r} on {model.source}'s multi-latent attention")
    return sizes[linear]


def _mla_linear_params(model: HFModelConfig, linear: str, rank: int, tp: int) -> tuple[float, float]:
    """(A, B) of the one adapter on an MLA linear, on one TP rank: A [r, in], B [out, r]; the up projections'
    (column-parallel) B split over TP, linear_proj's A, the down projections' neither."""
    fan_in, fan_out = _mla_sizes(model, linear)
    a, b = rank * fan_in, fan_out * rank
    if linear in COLUMN_PARALLEL_LINEARS:
        return a, b / tp
    if linear in DUPLICATED_LINEARS:
        return a, b
    return a / tp, b


def _is_expert_linear(model: HFModelConfig, layer: int, linear: str) -> bool:
    """Whether ``linear`` of ``layer`` is the MLP of an MoE layer: its adapters sit on the experts."""
    return linear in MLP_LINEARS and is_moe_layer(model, layer)


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
    if getattr(model, "mla", None) is not None and linear not in MLP_LINEARS:
        fan_in = _mla_sizes(model, linear)[0]
        return fan_in / tp if linear == "linear_proj" else fan_in
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
    mla = getattr(model, "mla", None)
    if mla is not None:  # linear_qkv named by a caller that does not know MLA: the model's query and key/value linears
        from megatron_rl.config.lora import mla_linears

        linears = [m for linear in linears for m in (mla_linears(mla)[:-1] if linear == "linear_qkv" else (linear,))]
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
