"""Megatron-Core GPTModel (one chunk per virtual pipeline stage) from an HF architecture config."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_rl.config.access import plain
from megatron_rl.config.schema import MegatronParallelConfig
from megatron_rl.models.attention import SDPAttention
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.config.lora import lora_on_experts
from megatron_rl.models.lora import LoRASpec, attach_lora
from megatron_rl.models.mla import MLA_DERIVED_FIELDS, mla_transformer_kwargs
from megatron_rl.models.mla_layers import DuplicatedLinear
from megatron_rl.models.moe import MOE_DERIVED_FIELDS, MOE_PARALLEL_FIELDS, moe_transformer_kwargs
from megatron_rl.models.moe_compat import (
    accept_whole_mla_down_projections,
    bind_missing_te_names,
    count_expert_bias_tokens_without_pads,
    disable_mla_te_check_without_te,
)
from megatron_rl.models.mtp import MTP_DERIVED_FIELDS, mtp_transformer_kwargs
from megatron_rl.models.mtp_model import MTPGPTModel
from megatron_rl.models.moe_experts import (
    ExpertLayer,
    check_grouped_gemm_override,
    choose_expert_layer,
    log_expert_layer,
)
from megatron_rl.models.sizes import DEFAULT_VOCAB_DIVISOR, check_parallel_fit, padded_vocab_size
from megatron_rl.models.value_head import attach_value_head
from megatron_rl.models.vision_model import VisionLanguageModel

# check_parallel_fit / padded_vocab_size live in sizes.py (no Megatron import) and are re-exported here.
__all__ = [
    "DEFAULT_VOCAB_DIVISOR",
    "build_gpt_model",
    "check_parallel_fit",
    "gpt_layer_spec",
    "make_transformer_config",
    "mark_tensor_parallel_weights",
    "padded_vocab_size",
    "transformer_overrides",
]

# TransformerConfig fields the builder sets from the HF config: override_transformer_config may repeat the value
# config.json gives (verl's scripts do: moe_router_enable_expert_bias=True), checked where the builder knows it
# (make_transformer_config), but not set another.
MODEL_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
    "kv_channels", "normalization", "layernorm_epsilon", "gated_linear_unit", "activation_func",
    "add_bias_linear", "add_qkv_bias", "qk_layernorm", "window_size", *MOE_DERIVED_FIELDS, *MLA_DERIVED_FIELDS,
)
# TransformerConfig fields the builder sets from the parallel state or another megatron key; override_transformer_config
# may not set them (the value would contradict the process groups). Field -> what sets it.
DERIVED_FIELDS = {
    **{name: "actor_rollout_ref.model.mtp" for name in MTP_DERIVED_FIELDS},
    **{name: f"megatron.{name}" for name in MOE_PARALLEL_FIELDS},
    **{
        name: f"megatron.{name}"
        for name in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size",
            "virtual_pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel",
        )
    },
    **{name: "megatron.params_dtype" for name in ("params_dtype", "pipeline_dtype", "bf16", "fp16")},
}


def _transformer_config_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(TransformerConfig) if not f.name.startswith("_")}


def check_transformer_overrides(overrides: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """``overrides`` as plain values, or a ValueError naming each unknown or derived field.

    ``prefix`` is the config key of the mapping (``actor_rollout_ref.actor.megatron.override_transformer_config``).
    """
    overrides = dict(plain(overrides) or {})
    known = _transformer_config_fields()
    problems = []
    for name in overrides:
        if name in DERIVED_FIELDS:
            problems.append(f"{prefix}.{name} cannot be overridden: it is set from {DERIVED_FIELDS[name]}")
        elif name not in known:
            nearest = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
            hint = f"; nearest: {', '.join(nearest)}" if nearest else ""
            problems.append(f"{prefix}.{name} is not a Megatron-Core TransformerConfig field{hint}")
    if problems:
        raise ValueError("; ".join(problems))
    return overrides


def transformer_overrides(parallel: MegatronParallelConfig, prefix: str) -> dict[str, Any]:
    """The TransformerConfig settings a role's ``megatron`` config asks for, checked:
    ``sequence_parallel`` and every ``override_transformer_config`` field (unknown or derived
    fields raise a ValueError naming them). The engine and the planner both build from this."""
    overrides = check_transformer_overrides(
        getattr(parallel, "override_transformer_config", None) or {}, f"{prefix}.override_transformer_config"
    )
    return {"sequence_parallel": bool(getattr(parallel, "sequence_parallel", False)), **overrides}


def _parallel_sizes(
    layout: tuple[int, int, int | None, int] | None, expert_layout: tuple[int, int] | None
) -> tuple[int, int, int | None, int, int, int]:
    """(tp, pp, vpp, cp, ep, etp): ``layout`` and ``expert_layout`` where given, else Megatron's parallel state
    (the experts' only without a ``layout`` either: default (1, tp))."""
    if layout is None:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        cp = parallel_state.get_context_parallel_world_size()
    else:
        tp, pp, vpp, cp = layout
    if expert_layout is None and layout is None:
        expert_layout = (
            parallel_state.get_expert_model_parallel_world_size(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    ep, etp = expert_layout or (1, tp)
    return tp, pp, vpp, cp, ep, etp


def _architecture_kwargs(hf: HFModelConfig) -> dict[str, Any]:
    """The TransformerConfig fields of the HF model's Llama block: sizes, norm, SwiGLU, biases, attention."""
    return dict(
        num_layers=hf.num_layers,
        hidden_size=hf.hidden_size,
        ffn_hidden_size=hf.intermediate_size,
        num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads,
        kv_channels=hf.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf.qkv_bias,
        qk_layernorm=hf.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        window_size=(hf.sliding_window - 1, 0) if hf.sliding_window else None,
    )


def make_transformer_config(
    hf: HFModelConfig,
    params_dtype: torch.dtype = torch.float32,
    init_weights: bool = True,
    *,
    layout: tuple[int, int, int | None, int] | None = None,
    expert_layout: tuple[int, int] | None = None,
    experts: ExpertLayer | None = None,
    **overrides: Any,
) -> TransformerConfig:
    """TransformerConfig for ``hf`` at the TP/PP/VPP/CP sizes of Megatron's initialised parallel state,
    or at ``layout`` = (tp, pp, vpp, cp) without one (what the planner does); for an MoE model also at its
    EP/ETP sizes (``expert_layout`` = (ep, etp) without a parallel state, default (1, tp)) and expert layer
    (``experts``, from ``choose_expert_layer``; None: as ``overrides`` say, SequentialMLP by default).

    ``overrides`` go straight to TransformerConfig (e.g. ``sequence_parallel=True``,
    ``recompute_granularity="full"``); ``transformer_overrides`` checks a config's.
    """
    tp, pp, vpp, cp, ep, etp = _parallel_sizes(layout, expert_layout)
    # refused before launch: the planner builds this config too
    check_grouped_gemm_override(overrides.get("moe_grouped_gemm"))
    check_parallel_fit(hf, tp, pp, vpp, ep=ep, etp=etp, first=overrides.get("num_layers_in_first_pipeline_stage"),
                       last=overrides.get("num_layers_in_last_pipeline_stage"))
    kwargs: dict[str, Any] = dict(
        **_architecture_kwargs(hf),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        # TE's CP attention: the ring (p2p) overlaps each K/V chunk's transfer with attention on the previous
        # one and holds 2 chunks of T / CP, not the whole sequence (override_transformer_config.cp_comm_type)
        cp_comm_type="p2p" if cp > 1 else None,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # RL micro-batches differ in length; let pipeline stages exchange shapes.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # dense model; the allgather default rejects the line above
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=init_weights,
        # Fused kernels come from TE/Apex/CUDA; the plain-torch paths run everywhere.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        # Interleaved PP=2: both neighbours are the same rank, so batched p2p posts the forward
        # activation and the backward gradient to one peer on one channel and they can swap (seen
        # with gloo). The unbatched path sends the two directions over different groups.
        batch_p2p_comm=not (pp == 2 and vpp is not None),
    )
    if hf.moe is not None:
        kwargs.update(moe_transformer_kwargs(hf.moe, ep, etp, experts))
    if hf.mla is not None:
        kwargs.update(mla_transformer_kwargs(hf.mla, hf.rope_theta))
    if hf.vision is not None:
        kwargs["mrope_section"] = list(hf.vision.mrope_section)
    check_model_fields(kwargs, overrides, hf.source)
    kwargs.update(overrides)
    return (MLATransformerConfig if hf.mla is not None else TransformerConfig)(**kwargs)


def check_model_fields(derived: Mapping[str, Any], overrides: Mapping[str, Any], source: str,
                       prefix: str = "override_transformer_config") -> None:
    """An override of a field the builder sets from config.json (``MODEL_FIELDS``) must repeat its value."""
    for name in sorted(set(overrides) & set(MODEL_FIELDS)):
        if name in derived and overrides[name] != derived[name]:
            raise ValueError(f"{prefix}.{name}={overrides[name]!r} contradicts {source}, from which the builder sets "
                             f"it to {derived[name]!r}: drop it (or change config.json, "
                             "actor_rollout_ref.model.override_config)")


def model_fields(hf: HFModelConfig) -> dict[str, Any]:
    """The TransformerConfig fields config.json decides (``MODEL_FIELDS``), as ``make_transformer_config`` sets them."""
    kwargs = _architecture_kwargs(hf)
    if hf.moe is not None:
        kwargs.update(moe_transformer_kwargs(hf.moe, 1, 1))
    if hf.mla is not None:
        kwargs.update(mla_transformer_kwargs(hf.mla, hf.rope_theta))
    return {name: value for name, value in kwargs.items() if name in MODEL_FIELDS}


def te_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


class LocalRMSNorm(torch.nn.RMSNorm):
    """The local spec's RMSNorm (torch's), usable under sequence parallelism.

    Megatron-Core 0.16.1's WrappedTorchNorm refuses ``sequence_parallel``: under SP each TP rank
    normalises its slice of the sequence, so a norm weight's gradient is a partial sum that must be
    summed over TP. ``finalize_model_grads`` does that for parameters marked ``sequence_parallel``
    (TE's and Apex's norms mark theirs); this one marks its weight the same way.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


class LatentRMSNorm(LocalRMSNorm):
    """MLA's q_a / kv_a norms: transformers' (and DeepSeek's own) DeepseekV3Attention builds them as
    ``DeepseekV3RMSNorm(rank)``, eps 1e-6 whatever ``rms_norm_eps`` says; Megatron would pass
    ``layernorm_epsilon`` (equal for DeepSeek-V3's own config, not for every checkpoint)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_unused: Any) -> None:
        super().__init__(config, hidden_size, eps=1e-6)


def _unfuse_te_norms(spec: ModuleSpec) -> None:
    """TE's spec fuses the pre-attention and pre-MLP norms into linear_qkv / linear_fc1; a LoRA adapter joins
    those linears through their input, which must be the normalised one: the norms become TENorm modules
    of their own and the linears plain TEColumnParallelLinear. MLA's spec fuses its latent norms (q_layernorm,
    kv_layernorm) into linear_q_up_proj / linear_kv_up_proj instead: those are unfused the same way."""
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

    spec.submodules.input_layernorm = TENorm
    attention = spec.submodules.self_attention.submodules
    if hasattr(attention, "linear_kv_up_proj"):  # MLA: the latent norms are fused into the up projections
        attention.q_layernorm = attention.kv_layernorm = TENorm
        attention.linear_q_up_proj = attention.linear_kv_up_proj = TEColumnParallelLinear
    else:
        attention.linear_qkv = TEColumnParallelLinear
    mlp = spec.submodules.mlp.submodules
    if hasattr(mlp, "linear_fc1"):
        spec.submodules.pre_mlp_layernorm = TENorm
        mlp.linear_fc1 = TEColumnParallelLinear


def gpt_layer_spec(
    hf: HFModelConfig,
    use_te: bool,
    context_parallel: bool = False,
    lora: bool = False,
    *,
    dense: bool = False,
    grouped_experts: bool = False,
) -> ModuleSpec:
    """TE's layer spec on CUDA when TE is importable, the local spec otherwise; the attention core is
    SDPAttention so the explicit causal+padding mask means the same thing on every backend, except under
    context parallelism with TE: TE's attention then runs the CP exchange (``cp_comm_type``, p2p by default)
    on the packed sequences CP requires, where SDPAttention would all-gather K/V.
    The local spec's norms are LocalRMSNorm (sequence parallelism works without TE too). An MoE model's
    MLP is Megatron's MoELayer (a shared expert builds Megatron's SharedExpertMLP from the TransformerConfig)
    whose experts are SequentialMLP (one MLP per local expert, every backend) or, with ``grouped_experts``
    (TE spec only; models/moe_experts.py chooses), TEGroupedMLP. ``dense=True``: the spec of an MoE model's
    dense layers."""
    experts = hf.moe.num_experts if hf.moe is not None and not dense else None
    if experts is not None:
        bind_missing_te_names()
        if hf.moe.expert_bias:
            count_expert_bias_tokens_without_pads()
    if grouped_experts and not use_te:
        # the local spec's grouped layer is Megatron's legacy GroupedMLP (another layout, another package)
        raise ValueError("grouped experts (moe_grouped_gemm=true) need Transformer Engine's layer spec "
                         "(use_te)")
    mla = hf.mla is not None
    if mla:
        disable_mla_te_check_without_te()
    # MLA: Megatron's MLASelfAttention; its q_layernorm / kv_layernorm (the q_a / kv_a norms) are built only
    # with qk_layernorm
    qk_norm = hf.qk_norm or mla
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=grouped_experts, qk_layernorm=qk_norm,
            multi_latent_attention=mla,
        )
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=qk_norm, normalization="RMSNorm",
            multi_latent_attention=mla,
        )
        spec.submodules.input_layernorm = LocalRMSNorm
        spec.submodules.pre_mlp_layernorm = LocalRMSNorm
        attention = spec.submodules.self_attention.submodules
        if mla:
            attention.q_layernorm = attention.kv_layernorm = LatentRMSNorm
            # whole on every TP rank, as TE's spec has them: the split ones lose the RoPE key's gradient at TP > 1
            accept_whole_mla_down_projections()
            attention.linear_q_down_proj = attention.linear_kv_down_proj = DuplicatedLinear
        elif hf.qk_norm:
            attention.q_layernorm = attention.k_layernorm = LocalRMSNorm
    if not (use_te and context_parallel):
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if use_te and lora:
        _unfuse_te_norms(spec)
    return spec


def _block_spec(
    layer_spec: ModuleSpec,
    config: TransformerConfig,
    vp_stage: int | None,
    use_te: bool,
    dense_spec: ModuleSpec | None = None,
):
    """The layer spec as GPTModel takes it; for the local spec a whole block, so that the final
    norm is a LocalRMSNorm too (Megatron would pick WrappedTorchNorm). ``dense_spec``: an MoE model with
    dense layers (``config.moe_layer_freq`` a 0/1 list) gets it for its dense layers, the block being cut to
    the layers of this (virtual) stage as Megatron's ``get_gpt_decoder_block_spec`` cuts it."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    pattern = None
    if dense_spec is not None and isinstance(config.moe_layer_freq, list):
        pattern = config.moe_layer_freq
    if use_te and pattern is None:
        return layer_spec
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    if pattern is None:
        specs = [layer_spec] * layers
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        specs = [layer_spec if pattern[i] else dense_spec for i in range(offset, offset + layers)]
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TransformerBlockSubmodules(layer_specs=specs, layer_norm=TENorm)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=specs, layer_norm=LocalRMSNorm),
    )


def _mtp_block_spec(layer_spec: ModuleSpec, num_layers: int, use_te: bool):
    """Megatron's MTP block of ``num_layers`` layers around ``layer_spec`` (models/mtp.py), with the local spec's
    norms (LocalRMSNorm, as the decoder's) or TE's."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

        norm, linear = TENorm, TEColumnParallelLinear
    else:
        norm, linear = LocalRMSNorm, ColumnParallelLinear
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=linear, transformer_layer=layer_spec, layer_norm=norm
        ),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_layers)


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Megatron-Core 0.16.1 tags TP-sharded weights (``tensor_model_parallel``, ``partition_dim``) only
    inside its random initialisation. Without it (weights loaded afterwards) every sharded weight looks
    replicated, and the gradient norm used for clipping counts it on TP rank 0 only. Tag them here."""
    split_dims = ((VocabParallelEmbedding, 0), (ColumnParallelLinear, 0), (RowParallelLinear, 1))
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        for cls, dim in split_dims:
            if isinstance(module, cls):
                set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
                break


def _rope_kwargs(hf: HFModelConfig) -> dict[str, Any]:
    """GPTModel's RoPE arguments beyond the base: scaling, and the share of each head rotated."""
    # GLM-4.5: RoPE on the first rotary_percent of each head; rotary_interleaved stays False (rotate_half),
    # transformers' layout (hf_config._rotary_percent)
    kwargs: dict[str, Any] = dict(rotary_percent=hf.rotary_percent)
    if hf.rope_scaling is not None and hf.rope_scaling.kind == "llama3":
        kwargs.update(rope_scaling=True, rope_scaling_factor=hf.rope_scaling.factor)
    elif hf.rope_scaling is not None and hf.rope_scaling.kind == "linear":
        kwargs.update(seq_len_interpolation_factor=hf.rope_scaling.factor)
    return kwargs


def _check_buildable(hf: HFModelConfig, lora: LoRASpec | None, value_head: bool) -> None:
    """The combinations the builder does not build (refused before launch by validation too)."""
    if lora is not None and hf.mtp is not None:
        raise ValueError(f"{hf.source}: LoRA with the multi-token-prediction layers (model.mtp.enable) is not built here")
    if value_head and hf.mtp is not None:
        raise ValueError(f"{hf.source}: a value model does not build multi-token-prediction layers")
    if hf.vision is not None and hf.mtp is not None:
        raise ValueError(f"{hf.source}: multi-token prediction on a vision-language model is not built here")


def _layer_specs(hf: HFModelConfig, config: TransformerConfig, use_te: bool, lora: bool, grouped: bool):
    """(the layer spec, that of an MoE model's dense layers or None, the MTP block's or None)."""
    cp = config.context_parallel_size > 1
    spec = gpt_layer_spec(hf, use_te, context_parallel=cp, lora=lora, grouped_experts=grouped)
    dense_spec = None
    if hf.moe is not None and hf.moe.layer_pattern:  # dense layers between the MoE layers
        dense_spec = gpt_layer_spec(hf, use_te, context_parallel=cp, lora=lora, dense=True)
    mtp_spec = None
    if hf.mtp is not None:
        mtp_layer = spec if hf.mtp.moe_layer or dense_spec is None else dense_spec
        mtp_spec = _mtp_block_spec(mtp_layer, hf.mtp.num_layers, use_te)
    return spec, dense_spec, mtp_spec


def build_gpt_model(
    hf: HFModelConfig,
    *,
    value_head: bool = False,
    value_head_init: str = "normal",
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    use_te: bool | None = None,
    init_weights: bool = True,
    parallel_output: bool = True,
    lora: LoRASpec | None = None,
    mtp_loss_scaling_factor: float = 0.1,
    **config_overrides: Any,
) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage, else a list of one).

    Needs Megatron's parallel state (``megatron_rl.distributed.init_model_parallel``). Each chunk
    carries ``chunk.hf_config`` (the HFModelConfig) for loading and export. ``value_head=True``
    builds the critic: untied embeddings and a ValueHead (hidden -> 1) on the last stage.
    ``init_weights=False`` skips random initialisation when weights are loaded right after.
    ``lora``: LoRA adapters on the targeted linears (models/lora.py); the engine freezes the rest.
    ``hf.mtp`` (models/mtp.py ``with_mtp``): the multi-token-prediction layers, on the last stage, in an
    ``MTPGPTModel`` (models/mtp_model.py) whose MTP loss weighs ``mtp_loss_scaling_factor``.
    """
    if use_te is None:
        use_te = te_available()
    _check_buildable(hf, lora, value_head)
    if hf.mtp is not None:
        config_overrides.update(mtp_transformer_kwargs(hf.mtp, mtp_loss_scaling_factor))
    experts = None
    if hf.moe is not None:  # override_transformer_config.moe_grouped_gemm is decided here, once
        experts = choose_expert_layer(
            config_overrides.pop("moe_grouped_gemm", None), cuda=torch.cuda.is_available(), te=use_te,
            lora_on_experts=lora is not None and lora_on_experts(lora, hf),
        )
        log_expert_layer(experts)
    config = make_transformer_config(
        hf, params_dtype=params_dtype, init_weights=init_weights, experts=experts, **config_overrides
    )
    spec, dense_spec, mtp_spec = _layer_specs(hf, config, use_te, lora is not None,
                                              experts is not None and experts.grouped)
    vocab = padded_vocab_size(hf.vocab_size, config.tensor_model_parallel_size, make_vocab_size_divisible_by)
    rope_kwargs = _rope_kwargs(hf)

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model_cls, model_kwargs = GPTModel, {}
        if mtp_spec is not None:
            model_cls, model_kwargs = MTPGPTModel, {"mtp_block_spec": mtp_spec if last else None}
        if hf.vision is not None:
            model_cls, model_kwargs = VisionLanguageModel, {"vision": hf.vision}
        model = model_cls(
            config=config,
            transformer_layer_spec=_block_spec(spec, config, vp_stage, use_te, dense_spec),
            vocab_size=vocab,
            max_sequence_length=hf.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=last,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=hf.tie_word_embeddings and not value_head,
            position_embedding_type="rope" if hf.vision is None else "mrope",
            rotary_base=hf.rope_theta,
            vp_stage=vp_stage,
            **rope_kwargs,
            **model_kwargs,
        )
        if not init_weights:
            mark_tensor_parallel_weights(model)
        if value_head and model.post_process:
            attach_value_head(model, init=value_head_init, bias=not hf.sequence_classifier)
        if lora is not None:
            attach_lora(model, lora, hf)
        model.hf_config = hf
        chunks.append(model)
    return chunks
