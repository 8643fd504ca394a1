"""A Megatron role's layout as the planner sizes it: its parallel sizes, the TransformerConfig the engine builds
for it, and whether the model factors over them."""
from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_rl.config import ConfigError
from megatron_rl.config.access import megatron_section, replace_path
from megatron_rl.config.schema import ActorConfig, CriticConfig, MegatronParallelConfig, ModelConfig, PPOTrainerConfig
from megatron_rl.models.builder import make_transformer_config, transformer_overrides
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.sizes import check_parallel_fit
from megatron_rl.plan.context_parallel import check_context_parallel_model, cp_comm_type
from megatron_rl.plan.memory import Layout, Recompute
from megatron_rl.plan.report import PlanError
ACTOR = "actor_rollout_ref.actor"
REF = "actor_rollout_ref.ref"
ROLLOUT = "actor_rollout_ref.rollout"
ROLE_PREFIX = {"actor": ACTOR, "critic": "critic"}


def trained_role(cfg: PPOTrainerConfig, role: str) -> ActorConfig | CriticConfig:
    """The section of a trained role ("actor" or "critic")."""
    return cfg.actor_rollout_ref.actor if role == "actor" else cfg.critic


def role_model(cfg: PPOTrainerConfig, role: str) -> ModelConfig:
    """The model section of a trained role ("actor" or "critic")."""
    return cfg.actor_rollout_ref.model if role == "actor" else cfg.critic.model


def role_layout(cfg: PPOTrainerConfig, prefix: str, world: int) -> Layout:
    mcfg = megatron_section(cfg, prefix)
    tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
    if world % (tp * pp * cp):  # validate() checks the trained roles; the reference is checked here
        raise PlanError(f"{prefix}.megatron: TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide the "
                        f"world size {world}")
    overrides = mcfg.override_transformer_config or {}
    return Layout(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp),
                  vpp=mcfg.virtual_pipeline_model_parallel_size, sequence_parallel=mcfg.sequence_parallel,
                  ep=mcfg.expert_model_parallel_size, etp=mcfg.expert_tensor_parallel_size,
                  first_stage_layers=overrides.get("num_layers_in_first_pipeline_stage"),
                  last_stage_layers=overrides.get("num_layers_in_last_pipeline_stage"))


def params_dtype(cfg: PPOTrainerConfig, mcfg: MegatronParallelConfig) -> str:
    if mcfg.params_dtype != "auto":
        return mcfg.params_dtype
    return "fp32" if cfg.trainer.device == "cpu" else "bf16"  # what "auto" picks on each device


def transformer_config(cfg: PPOTrainerConfig, prefix: str, model: HFModelConfig, layout: Layout,
                       dtype: str) -> TransformerConfig:
    """The Megatron-Core TransformerConfig the engine builds for this role: the same function
    (models.builder.make_transformer_config) with the same checked ``megatron`` overrides
    (sequence_parallel, override_transformer_config), at the role's layout. The planner reads sequence
    parallelism and recompute from it, so what it counts is what Megatron gets; Megatron's own refusals
    (recompute_granularity=full without recompute_method, sequence parallelism at TP=1, ...) come here,
    before launch, with the key named."""
    try:
        overrides = transformer_overrides(megatron_section(cfg, prefix), f"{prefix}.megatron")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return make_transformer_config(
                model, torch.float32 if dtype in ("fp32", "float32") else torch.bfloat16, init_weights=False,
                layout=(layout.tp, layout.pp, layout.vpp, layout.cp),
                expert_layout=(layout.ep, layout.tp if layout.etp is None else layout.etp), **overrides)
    except (ValueError, AssertionError, TypeError, ImportError) as err:
        kernels = te_kernel_flags(overrides)
        if kernels and not transformer_engine_here():
            # a kernel choice only TE has (verl's scripts set several) moves no memory: plan without it here;
            # a launch without TE is refused by check_launch, naming the keys
            return transformer_config_without(cfg, prefix, model, layout, dtype, kernels)
        raise PlanError(f"{prefix}.megatron (sequence_parallel and override_transformer_config {overrides}): "
                        f"Megatron-Core's TransformerConfig refuses it: {err}") from err


# TransformerConfig fields that pick a fused kernel (Transformer Engine's or Apex's), not what is stored
TE_KERNEL_FLAGS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                   "gradient_accumulation_fusion", "persist_layer_norm", "moe_grouped_gemm", "moe_permute_fusion",
                   "moe_router_fusion")


def te_kernel_flags(overrides: dict[str, Any]) -> list[str]:
    return [k for k in TE_KERNEL_FLAGS if overrides.get(k)]


def importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def transformer_engine_here() -> bool:
    return importable("transformer_engine")


def transformer_config_without(cfg: PPOTrainerConfig, prefix: str, model: HFModelConfig, layout: Layout, dtype: str,
                               kernels: list[str]) -> TransformerConfig:
    """``transformer_config`` with the fused-kernel flags ``kernels`` of the role's overrides set false."""
    without = cfg
    for key in kernels:
        without = replace_path(without, f"{prefix}.megatron.override_transformer_config.{key}", False)
    return transformer_config(without, prefix, model, layout, dtype)


def recompute_of(tcfg: TransformerConfig) -> Recompute:
    """Recompute as the built TransformerConfig has it (megatron.override_transformer_config)."""
    return Recompute(tcfg.recompute_granularity, tcfg.recompute_method or "uniform",
                     int(tcfg.recompute_num_layers or 1))


def check_factors(model: HFModelConfig, prefix: str, layout: Layout, cfg: PPOTrainerConfig | None = None) -> None:
    if cfg is not None:  # what CP > 1 needs from the model (MoE, a2a's heads, windows): refused naming the key
        check_context_parallel_model(model, prefix, layout.cp, layout.tp, cp_comm_type(megatron_section(cfg, prefix)),
                                     te_attention=str(cfg.trainer.device) != "cpu")
    try:
        check_parallel_fit(model, layout.tp, layout.pp, layout.vpp, ep=layout.ep, etp=layout.etp,
                           first=layout.first_stage_layers, last=layout.last_stage_layers)
        if (layout.tp * layout.cp * layout.dp) % layout.expert_shards:
            raise ValueError(f"EP*ETP = {layout.expert_shards} does not divide the "
                             f"{layout.tp * layout.cp * layout.dp} ranks of a pipeline stage. Megatron-Core's "
                             "initialize_model_parallel refuses the same layout, so verl's own run of this config "
                             "fails at start too: more nodes, or a smaller expert_model_parallel_size / "
                             "expert_tensor_parallel_size")
    except ValueError as err:
        raise PlanError(f"{prefix}.megatron (TP={layout.tp}, PP={layout.pp}, EP={layout.ep}) does not factor this "
                        f"model: {err}") from err


def check_rollout_factors(model: HFModelConfig, tp: int) -> None:
    heads, groups = model.num_attention_heads, model.num_key_value_heads
    if heads % tp or (groups % tp and tp % groups):
        raise PlanError(f"{ROLLOUT}.tensor_model_parallel_size={tp} does not factor this model: the engine splits "
                        f"num_attention_heads={heads} over TP and needs num_key_value_heads={groups} to be a "
                        f"multiple or a divisor of TP")
