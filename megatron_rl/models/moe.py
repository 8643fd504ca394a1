"""Mixture-of-experts facts of an HF config (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5) and how they map
to Megatron-Core.

No Megatron import: the planner and hf_config read this module before any worker starts.

Routing, HF vs Megatron-Core 0.16.1 (``topk_routing_with_score_function``):
* HF (all three families): p = softmax(router logits) over all experts, keep the top k; with
  ``norm_topk_prob`` (Mixtral always) the k kept values are renormalised to sum 1.
* Renormalised top-k of a softmax is the softmax of the top-k logits (the full-softmax denominator
  cancels), which is Megatron's ``moe_router_pre_softmax=False``; without renormalisation it is
  Megatron's ``moe_router_pre_softmax=True`` (softmax first, top-k of the probabilities).
Experts are dropless (no capacity factor), as in HF.

Shared experts (Qwen2-MoE): every MoE layer also runs one dense SwiGLU MLP of
``shared_expert_intermediate_size`` on every token, scaled by sigmoid(shared_expert_gate . x), and adds it
to the routed output. That is Megatron-Core's ``SharedExpertMLP`` with ``moe_shared_expert_gate=True``
(``gate_weight`` [1, hidden], the same sigmoid), split over TP like a dense MLP.

Dense layers between MoE layers (Qwen2-MoE, Qwen3-MoE): layer i (0-based) is MoE unless it is in
``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers' rule); a dense layer is a plain
SwiGLU MLP of ``intermediate_size``. Megatron-Core takes the pattern as ``moe_layer_freq`` (a 0/1 list).

DeepSeek-V3 (transformers' DeepseekV3TopkRouter; GLM-4.5's Glm4MoeTopkRouter is the same): s = sigmoid(router logits); the choice ranks
s + e_score_correction_bias, restricted to the ``topk_group`` best of ``n_group`` expert groups (a group's score:
its two best biased scores); the weights are the chosen s (without the bias), renormalised (norm_topk_prob) and
times ``routed_scaling_factor``. Megatron-Core: ``moe_router_score_function="sigmoid"``, the bias in
``Router.expert_bias`` (``moe_router_enable_expert_bias``, a buffer, never trained by gradient),
``moe_router_num_groups`` / ``moe_router_group_topk`` (a group's score: its top topk/group_topk scores: equal
when that is 2) and ``moe_router_topk_scaling_factor``. ``n_shared_experts`` ungated shared experts are one
SharedExpertMLP of n_shared_experts x moe_intermediate_size; the first ``first_k_dense_replace`` layers dense.

Expert placement: Megatron gives EP rank r the experts ``[r * E / EP, (r + 1) * E / EP)`` (contiguous);
each expert's fc1 (gate|up) and fc2 are split over the expert-tensor-parallel group (ETP) like a dense
MLP's over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_rl.models.moe_experts import ExpertLayer

# model_type -> (router name, {role: expert tensor name}) inside ``model.layers.<i>.``
_HF_NAMES = {
    "qwen2_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "deepseek_v3": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "glm4_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "hy_v3": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
MOE_MODEL_TYPES = tuple(_HF_NAMES)
# Families whose configs place dense layers with decoder_sparse_step / mlp_only_layers (transformers' rule).
_SPARSE_STEP_TYPES = ("qwen2_moe", "qwen3_moe")
# Families routed as DeepSeek-V3 routes (transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter are the same code),
# with the defaults of their transformers config classes for fields a config.json may leave out.
_SIGMOID_ROUTED_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": dict(first_k_dense_replace=3, n_shared_experts=1, routed_scaling_factor=2.5, n_group=8,
                        topk_group=4, norm_topk_prob=True),
    "glm4_moe": dict(first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=1.0, n_group=1,
                     topk_group=1, norm_topk_prob=True),
}


@dataclass(frozen=True)
class MoESpec:
    """The MoE block of an MoE model's layers, which layers have it, and its shared expert."""

    num_experts: int
    topk: int
    ffn_hidden_size: int  # per expert
    norm_topk_prob: bool
    block: str  # HF module name of the MoE block in a layer: "mlp" or "block_sparse_moe"
    expert_names: tuple[tuple[str, str], ...]  # (role, HF tensor name) for gate, up, down
    router_aux_loss_coef: float  # the HF config's value, for information (training sets its own)
    # One flag per layer: True = MoE block, False = dense SwiGLU MLP of intermediate_size. Empty = all MoE.
    layer_pattern: tuple[bool, ...] = ()
    shared_expert_size: int | None = None  # shared_expert_intermediate_size; None = no shared expert
    shared_expert_gate: bool = False  # sigmoid(shared_expert_gate . x) scales the shared expert's output
    dense_ffn_hidden_size: int | None = None  # intermediate_size of the dense layers; None = no dense layer
    # DeepSeek-V3 routing (see the module docstring): sigmoid scores, a selection bias, group-limited top-k,
    # a scale on the combined weights; the shared experts live under ``shared_experts``, ungated.
    score_function: str = "softmax"
    expert_bias: bool = False  # mlp.gate.e_score_correction_bias: added to the scores for the choice only
    num_groups: int | None = None
    group_topk: int | None = None
    topk_scaling_factor: float | None = None
    shared_expert_block: str = "shared_expert"
    # the router's and its bias's modules in the MoE block: DeepSeek's gate / gate.e_score_correction_bias, Hy3's
    # checkpoint router.gate / expert_bias
    router_module: str = "gate"
    bias_module: str = "gate.e_score_correction_bias"

    def is_moe_layer(self, layer: int) -> bool:
        return not self.layer_pattern or self.layer_pattern[layer]

    def moe_layers(self, num_layers: int) -> int:
        """How many of the model's ``num_layers`` layers are MoE layers."""
        return sum(self.is_moe_layer(i) for i in range(num_layers))

    def shared_expert_name(self, layer: int, role: str) -> str:
        """HF name of the shared expert's ``role`` (gate, up, down), or of its sigmoid gate (``"gate_score"``)."""
        if role == "gate_score":
            return f"model.layers.{layer}.{self.block}.shared_expert_gate.weight"
        return f"model.layers.{layer}.{self.block}.{self.shared_expert_block}.{role}_proj.weight"

    def router_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}.{self.router_module}.weight"

    def router_bias_name(self, layer: int) -> str:
        return f"model.layers.{layer}.{self.block}.{self.bias_module}"

    def expert_name(self, layer: int, expert: int, role: str) -> str:
        return f"model.layers.{layer}.{self.block}.experts.{expert}.{dict(self.expert_names)[role]}.weight"


def parse_moe_config(hf_config: dict[str, Any], model_type: str, source: str) -> MoESpec | None:
    """The MoESpec of an MoE family's config.json dict (None for dense families); refusals name the field."""
    from megatron_rl.models.hf_config import UnsupportedModelError  # import cycle: hf_config imports this module

    if model_type not in _HF_NAMES:
        return None

    def refuse(message: str) -> None:
        raise UnsupportedModelError(f"{source}: {message}")

    # Qwen3-MoE writes num_experts, Mixtral (and transformers 5 for both) num_local_experts.
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts", hf_config.get("n_routed_experts")))
    if experts is None:
        refuse("missing required field 'num_experts' (or 'num_local_experts')")
    topk = hf_config.get("num_experts_per_tok")
    if topk is None:
        refuse("missing required field 'num_experts_per_tok'")
    experts, topk = int(experts), int(topk)
    if not 1 <= topk <= experts:
        refuse(f"num_experts_per_tok={topk} must be between 1 and the number of experts ({experts})")
    if model_type in _SIGMOID_ROUTED_DEFAULTS:
        return _sigmoid_routed_moe(hf_config, model_type, experts_per_token=topk, refuse=refuse)
    if model_type == "hy_v3":
        return _hy_v3_moe(hf_config, experts, topk, refuse)
    shared, pattern = None, ()
    if model_type in _SPARSE_STEP_TYPES:
        ffn = hf_config.get("moe_intermediate_size")
        if ffn is None:
            refuse("missing required field 'moe_intermediate_size'")
        pattern = _layer_pattern(hf_config, refuse)
        norm_topk = bool(hf_config.get("norm_topk_prob", False))
        if model_type == "qwen2_moe":
            shared = hf_config.get("shared_expert_intermediate_size")
            if shared is None:
                refuse("missing required field 'shared_expert_intermediate_size'")
            if int(shared) <= 0:
                refuse(
                    f"shared_expert_intermediate_size={shared} must be positive "
                    "(Qwen2-MoE always has a shared expert)"
                )
            shared = int(shared)
    else:  # mixtral: always renormalised, expert size is intermediate_size, every layer MoE
        ffn = hf_config["intermediate_size"]
        norm_topk = True
        if float(hf_config.get("router_jitter_noise", 0.0) or 0.0) != 0.0:
            refuse(f"router_jitter_noise={hf_config['router_jitter_noise']} is not supported (only 0.0)")
    block, names = _HF_NAMES[model_type]
    return MoESpec(
        num_experts=experts,
        topk=topk,
        ffn_hidden_size=int(ffn),
        norm_topk_prob=norm_topk,
        block=block,
        expert_names=tuple(names.items()),
        router_aux_loss_coef=float(hf_config.get("router_aux_loss_coef", 0.0) or 0.0),
        layer_pattern=pattern,
        shared_expert_size=shared,
        shared_expert_gate=shared is not None,
        dense_ffn_hidden_size=int(hf_config["intermediate_size"]) if pattern else None,
    )


def _sigmoid_routed_moe(hf_config: dict[str, Any], model_type: str, experts_per_token: int, refuse) -> MoESpec:
    """DeepSeek-V3's MoE (transformers' DeepseekV3MoE / DeepseekV3TopkRouter; GLM-4.5's Glm4MoeMoE /
    Glm4MoeTopkRouter is the same code) as Megatron's router computes it."""
    defaults = _SIGMOID_ROUTED_DEFAULTS[model_type]

    def field(key: str) -> Any:
        value = hf_config.get(key)
        return defaults[key] if value is None else value

    for key in ("n_routed_experts", "moe_intermediate_size", "num_hidden_layers"):
        if hf_config.get(key) is None:
            refuse(f"missing required field {key!r}")
    experts, layers, ffn = (
        int(hf_config[k]) for k in ("n_routed_experts", "num_hidden_layers", "moe_intermediate_size")
    )
    # transformers: layer i is MoE iff i >= first_k_dense_replace (it ignores moe_layer_freq; refuse other values)
    if int(hf_config.get("moe_layer_freq") or 1) != 1:
        refuse(f"moe_layer_freq={hf_config['moe_layer_freq']} is not supported (only 1)")
    dense = int(field("first_k_dense_replace"))
    if not 0 <= dense < layers:
        refuse(f"first_k_dense_replace={dense} leaves no MoE layer among num_hidden_layers={layers}")
    pattern = tuple(i >= dense for i in range(layers))
    norm_topk = bool(field("norm_topk_prob"))
    if not norm_topk and experts_per_token > 1:
        # Megatron's sigmoid routing always renormalises the top-k (moe_utils.topk_routing_with_score_function)
        refuse("norm_topk_prob=false with sigmoid routing is not supported (Megatron-Core always renormalises)")
    # DeepSeek's own config fields (transformers' routers implement only these values)
    if hf_config.get("topk_method", "noaux_tc") != "noaux_tc":
        refuse(f"topk_method={hf_config['topk_method']!r} is not supported (only 'noaux_tc', transformers' rule)")
    if hf_config.get("scoring_func", "sigmoid") != "sigmoid":
        refuse(f"scoring_func={hf_config['scoring_func']!r} is not supported (only 'sigmoid')")
    groups, group_topk = int(field("n_group")), int(field("topk_group"))
    if groups > 1:
        if experts % groups or not 1 <= group_topk <= groups:
            refuse(f"n_group={groups} / topk_group={group_topk} do not split n_routed_experts={experts}")
        # transformers ranks groups by their top-2 scores, Megatron by their top-(topk / topk_group)
        if experts_per_token // group_topk != 2:
            refuse(f"num_experts_per_tok={experts_per_token} / topk_group={group_topk} must be 2 "
                   "(groups are ranked by their two best experts)")
    shared = int(field("n_shared_experts"))
    names = _HF_NAMES[model_type][1]
    return MoESpec(
        num_experts=experts,
        topk=experts_per_token,
        ffn_hidden_size=ffn,
        norm_topk_prob=norm_topk,
        block="mlp",
        expert_names=tuple(names.items()),
        router_aux_loss_coef=float(hf_config.get("aux_loss_alpha", 0.0) or 0.0),
        layer_pattern=() if all(pattern) else pattern,
        shared_expert_size=shared * ffn if shared else None,
        shared_expert_gate=False,
        dense_ffn_hidden_size=int(hf_config["intermediate_size"]) if not all(pattern) else None,
        score_function="sigmoid",
        expert_bias=True,
        # one group selects every expert: no group limit
        num_groups=groups if groups > 1 else None,
        group_topk=group_topk if groups > 1 else None,
        topk_scaling_factor=float(field("routed_scaling_factor")),
        shared_expert_block="shared_experts",
    )


def _hy_v3_moe(hf_config: dict[str, Any], experts: int, topk: int, refuse) -> MoESpec:
    """Hy3's MoE (transformers' HYV3MoE / HYV3TopKRouter): DeepSeek-V3's sigmoid routing with the correction bias,
    the top-k always renormalised (+1e-20, as Megatron's) and scaled by ``router_scaling_factor``, no expert groups;
    ``num_shared_experts`` ungated shared experts of ``moe_intermediate_size`` each; ``mlp_layer_types`` ("dense" /
    "sparse" per layer; transformers' default: the first dense). Its checkpoint names the router ``mlp.router.gate``,
    the bias ``mlp.expert_bias`` and the shared experts ``mlp.shared_mlp`` (transformers' conversion mapping)."""
    for key in ("moe_intermediate_size", "num_hidden_layers", "intermediate_size"):
        if hf_config.get(key) is None:
            refuse(f"missing required field {key!r}")
    layers, ffn = int(hf_config["num_hidden_layers"]), int(hf_config["moe_intermediate_size"])
    types = hf_config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
    if len(types) != layers or set(types) - {"dense", "sparse"} or "sparse" not in types:
        refuse(f"mlp_layer_types={types!r} must name 'dense' or 'sparse' for each of num_hidden_layers={layers}, "
               "at least one sparse")
    pattern = tuple(t == "sparse" for t in types)
    shared = int(hf_config.get("num_shared_experts") or 0)
    return MoESpec(
        num_experts=experts,
        topk=topk,
        ffn_hidden_size=ffn,
        norm_topk_prob=True,
        block="mlp",
        expert_names=tuple(_HF_NAMES["hy_v3"][1].items()),
        router_aux_loss_coef=0.0,
        layer_pattern=() if all(pattern) else pattern,
        shared_expert_size=shared * ffn if shared else None,
        shared_expert_gate=False,
        dense_ffn_hidden_size=int(hf_config["intermediate_size"]) if not all(pattern) else None,
        score_function="sigmoid",
        expert_bias=True,
        topk_scaling_factor=float(hf_config.get("router_scaling_factor") or 1.0),
        shared_expert_block="shared_mlp",
        router_module="router.gate",
        bias_module="expert_bias",
    )


def _layer_pattern(hf_config: dict[str, Any], refuse) -> tuple[bool, ...]:
    """transformers' Qwen-MoE rule per layer (True = MoE); () when every layer is MoE."""
    layers = int(hf_config["num_hidden_layers"]) if "num_hidden_layers" in hf_config else None
    step = hf_config.get("decoder_sparse_step", 1)
    if step is None or int(step) < 1:
        refuse(f"decoder_sparse_step={step} must be a positive integer")
    step = int(step)
    only = hf_config.get("mlp_only_layers") or []
    indices = isinstance(only, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in only
    )
    if not indices:
        refuse(f"mlp_only_layers={only!r} must be a list of layer indices")
    if layers is None:
        refuse("missing required field 'num_hidden_layers'")
    outside = sorted(i for i in only if not 0 <= i < layers)
    if outside:
        refuse(
            f"mlp_only_layers={list(only)}: {outside} outside 0..{layers - 1} (num_hidden_layers={layers})"
        )
    pattern = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
    if not any(pattern):
        refuse(
            f"decoder_sparse_step={step} / mlp_only_layers={list(only)} leave no MoE layer among "
            f"num_hidden_layers={layers}: that is a dense model (use the dense family's architecture)"
        )
    return () if all(pattern) else pattern


def moe_transformer_kwargs(
    moe: MoESpec, ep: int, etp: int, experts: ExpertLayer | None = None
) -> dict[str, Any]:
    """TransformerConfig fields for ``moe`` at expert-parallel size ``ep`` and expert-TP size ``etp``, with
    the expert layer ``experts`` (models/moe_experts.py: ``choose_expert_layer``). None (the planner, which
    builds no layer): SequentialMLP, unless override_transformer_config sets moe_grouped_gemm (no memory
    moves either way)."""
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        # see the module docstring: renormalised top-k == softmax over the top-k logits
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.0,  # training turns it on: override_transformer_config.moe_aux_loss_coeff
        # fp32 router logits and softmax: the top-k choice is the part of the model most sensitive to
        # rounding (a flipped expert changes the token's output), and HF's softmax is fp32 too.
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        # True: TEGroupedMLP (one grouped GEMM over the local experts); False: SequentialMLP (one MLP each)
        moe_grouped_gemm=experts is not None and experts.grouped,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        # dense layers (0) between MoE layers (1); 1 = every layer MoE
        moe_layer_freq=[int(m) for m in moe.layer_pattern] if moe.layer_pattern else 1,
        moe_shared_expert_intermediate_size=moe.shared_expert_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_shared_expert_overlap=False,  # the overlap runs the shared expert on a CUDA side stream
        moe_router_score_function=moe.score_function,
        moe_router_enable_expert_bias=moe.expert_bias,
        # the bias is a buffer (no gradient); Megatron's aux-loss-free update would move it after every step
        # (finalize_model_grads): off, so routing changes only with the trained weights
        # (override_transformer_config.moe_router_bias_update_rate turns it on)
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.topk_scaling_factor,
    )


# TransformerConfig fields moe_transformer_kwargs sets from the HF config (override_transformer_config
# may not change them: the checkpoint's routing would no longer be the model's).
MOE_DERIVED_FIELDS = (
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_layer_freq",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function",
    "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
)
MOE_PARALLEL_FIELDS = ("expert_model_parallel_size", "expert_tensor_parallel_size")


def local_experts(moe: MoESpec, ep: int, ep_rank: int) -> range:
    """Global indices of the experts EP rank ``ep_rank`` holds (Megatron's contiguous placement)."""
    per_rank = moe.num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def check_expert_parallel_fit(moe: MoESpec, tp: int, ep: int, etp: int, where: str) -> None:
    """Refuse EP/ETP (and TP, for the shared expert and the dense layers) sizes that do not split the MLPs
    evenly, naming the numbers."""
    if moe.shared_expert_size is not None and moe.shared_expert_size % tp:
        raise ValueError(
            f"{where}: shared_expert_intermediate_size={moe.shared_expert_size} is not divisible by TP={tp}"
        )
    if moe.dense_ffn_hidden_size is not None and moe.dense_ffn_hidden_size % tp:
        raise ValueError(
            f"{where}: intermediate_size={moe.dense_ffn_hidden_size} (the dense layers) "
            f"is not divisible by TP={tp}"
        )
    if moe.num_experts % ep:
        raise ValueError(f"{where}: num_experts={moe.num_experts} is not divisible by EP={ep}")
    if moe.ffn_hidden_size % etp:
        raise ValueError(
            f"{where}: moe_intermediate_size (per expert)={moe.ffn_hidden_size} is not divisible by ETP={etp}"
        )
    if etp not in (1, tp):
        # Export gathers expert shards over the TP group (ETP = TP: the same ranks) or not at all (ETP = 1).
        raise ValueError(f"{where}: expert_tensor_parallel_size={etp} must be 1 or the TP size ({tp})")
