"""Dry-run plan: the batch arithmetic of ``validate()`` plus memory per GPU, checked against the GPU.

``build_plan(cfg)`` raises ``PlanError`` (a ConfigError) when the layout does not factor for this model
or a phase of a step needs more memory than the GPU has; ``print_plan(cfg)`` is what ``--dry-run`` runs.
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from megatron_rl.config import ConfigError
from megatron_rl.config.lora import check_lora_model, lora_enabled, lora_targets
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.plan.validate import (
    DerivedSizes,
    RoleSizes,
    check_context_parallel_model,
    context_parallel_roles,
    cp_comm_type,
    validate,
)
from megatron_rl.models.sizes import check_parallel_fit, padded_vocab_size
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.plan import memory
from megatron_rl.rollout.engines import engine_of
from megatron_rl.rollout.memory import EngineMemory, EngineStart
from megatron_rl.plan.memory import Layout, Recompute, Stage
from megatron_rl.plan.model_facts import load_model_facts
from megatron_rl.rollout.mesh import build_rollout_mesh, default_places

GIB = 2**30
ACTOR = "actor_rollout_ref.actor"
REF = "actor_rollout_ref.ref"
ROLLOUT = "actor_rollout_ref.rollout"


class PlanError(ConfigError):
    """The plan cannot run: the layout does not factor for this model, or it does not fit in memory."""


@dataclass(frozen=True)
class MemoryRow:
    """Bytes per GPU of one item in each phase of a step (phase name -> bytes)."""

    label: str
    per_phase: dict[str, float]


@dataclass(frozen=True)
class RolloutShare:
    engines: int
    tp: int
    memory: EngineMemory  # per GPU, the engine's own reading of gpu_memory_utilization (rollout/memory.py)
    kv_tokens: int  # KV cache capacity of one engine, in tokens

    @property
    def reserved(self) -> float:
        """Bytes per GPU the knob grants the engine: weights + KV cache (+ what else the engine counts in it)."""
        return self.memory.budget

    @property
    def weights(self) -> float:
        return self.memory.start.weights

    @property
    def free_at_start(self) -> float:
        """Bytes per GPU free when the engine starts (after actor + reference)."""
        return self.memory.start.free

    @property
    def fraction(self) -> float:
        return self.memory.start.fraction

    @property
    def kv_cache(self) -> float:
        return self.memory.kv_cache


@dataclass(frozen=True)
class Plan:
    sizes: DerivedSizes
    model: HFModelConfig
    gpu_memory: float  # bytes
    actor_layout: Layout
    actor_stage: Stage
    phases: tuple[str, ...]
    rows: tuple[MemoryRow, ...]
    rollout: RolloutShare
    sequence_length: int  # prompt + response tokens
    notes: tuple[str, ...] = ()  # lines printed after the batch arithmetic (context parallelism's split)

    def total(self, phase: str) -> float:
        return sum(row.per_phase.get(phase, 0.0) for row in self.rows)

    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    @property
    def fits(self) -> bool:
        return self.total(self.peak_phase()) <= self.gpu_memory

    def format(self) -> str:
        model, layout, rollout = self.model, self.actor_layout, self.rollout
        params = memory.total_params(model)
        moe = model.moe
        active = (f" ({_count(memory.active_params(model))} active: top-{moe.topk} of {moe.num_experts} experts of "
                  f"ffn {moe.ffn_hidden_size}; experts over EP {layout.ep} x ETP {layout.etp or layout.tp})"
                  if moe is not None else "")
        lines = [
            f"model ({model.source}): {model.architecture}, {_count(params)} params{active}; hidden {model.hidden_size}, "
            f"{model.num_layers} layers, {model.num_attention_heads} heads / {model.num_key_value_heads} KV heads, "
            f"ffn {model.intermediate_size}, vocab {model.vocab_size} (padded to "
            f"{padded_vocab_size(model.vocab_size, layout.tp)} at TP={layout.tp})",
            f"GPUs: {self.sizes.world_size} = actor TP {layout.tp} x PP {layout.pp} x CP {layout.cp} x DP {layout.dp}",
            self.sizes.summary(),
            *self.notes,
            _rollout_line(rollout, self.sequence_length),
            f"memory per GPU in GiB, actor at its {self.actor_stage} pipeline stage:",
        ]
        width = max(len(row.label) for row in self.rows)
        lines.append("  " + " " * width + "".join(f"{phase:>15}" for phase in self.phases))
        for row in self.rows:
            lines.append(f"  {row.label:<{width}}" + "".join(f"{_gib(row.per_phase.get(p, 0.0)):>15}" for p in self.phases))
        lines.append(f"  {'total':<{width}}" + "".join(f"{_gib(self.total(p)):>15}" for p in self.phases))
        peak = self.peak_phase()
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"peak: {peak}, {_gib(self.total(peak))} of {_gib(self.gpu_memory)} GiB per GPU: {verdict}")
        return "\n".join(lines)


def _rollout_line(rollout: RolloutShare, sequence_length: int) -> str:
    mem = rollout.memory
    other = rollout.reserved - rollout.weights - rollout.kv_cache
    other_text = f" + activations and CUDA graphs {_gib(other)}" if other > 0 else ""
    asleep = f"; asleep it keeps {_gib(mem.asleep)} GiB" if mem.asleep else ""
    return (f"rollout: {rollout.engines} {mem.engine} engines of TP {rollout.tp} ({mem.meaning}); each GPU reserves "
            f"{rollout.fraction:g} x {_gib(mem.base)} GiB {mem.base_label} = {_gib(rollout.reserved)} GiB: weights "
            f"{_gib(rollout.weights)}{other_text} + KV cache {_gib(rollout.kv_cache)} GiB = {rollout.kv_tokens:,} tokens "
            f"({rollout.kv_tokens // sequence_length:,} sequences of {sequence_length} tokens) per engine{asleep}")


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f}"


def _count(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _layout(cfg: DictConfig, prefix: str, world: int) -> Layout:
    mcfg = OmegaConf.select(cfg, f"{prefix}.megatron")
    tp, pp, cp = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size, mcfg.context_parallel_size
    if world % (tp * pp * cp):  # validate() checks the trained roles; the reference is checked here
        raise PlanError(f"{prefix}.megatron: TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide the "
                        f"world size {world}")
    return Layout(tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp),
                  vpp=mcfg.virtual_pipeline_model_parallel_size, sequence_parallel=mcfg.sequence_parallel,
                  ep=OmegaConf.select(mcfg, "expert_model_parallel_size", default=1),
                  etp=OmegaConf.select(mcfg, "expert_tensor_parallel_size", default=None))


def transformer_config(cfg: DictConfig, prefix: str, model: HFModelConfig, layout: Layout, dtype: str) -> Any:
    """The Megatron-Core TransformerConfig the engine builds for this role: the same function
    (models.builder.make_transformer_config) with the same checked ``megatron`` overrides
    (sequence_parallel, override_transformer_config), at the role's layout. The planner reads sequence
    parallelism and recompute from it, so what it counts is what Megatron gets; Megatron's own refusals
    (recompute_granularity=full without recompute_method, sequence parallelism at TP=1, ...) come here,
    before launch, with the key named."""
    with warnings.catch_warnings():  # Megatron-Core warns about missing TE/Apex on import
        warnings.simplefilter("ignore")
        import torch

        from megatron_rl.models.builder import make_transformer_config, transformer_overrides
    mcfg = OmegaConf.select(cfg, f"{prefix}.megatron")
    try:
        overrides = transformer_overrides(mcfg, f"{prefix}.megatron")
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
        if kernels and not _transformer_engine_here():
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


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _transformer_engine_here() -> bool:
    return _importable("transformer_engine")


def transformer_config_without(cfg: DictConfig, prefix: str, model: HFModelConfig, layout: Layout, dtype: str,
                               kernels: list[str]) -> Any:
    without = copy.deepcopy(cfg)
    OmegaConf.set_readonly(without, False)
    for key in kernels:
        OmegaConf.update(without, f"{prefix}.megatron.override_transformer_config.{key}", False, merge=False)
    return transformer_config(without, prefix, model, layout, dtype)


def _recompute(tcfg: Any) -> Recompute:
    """Recompute as the built TransformerConfig has it (megatron.override_transformer_config)."""
    return Recompute(tcfg.recompute_granularity, tcfg.recompute_method or "uniform",
                     int(tcfg.recompute_num_layers or 1))


def _check_factors(model: HFModelConfig, prefix: str, layout: Layout, cfg: DictConfig | None = None) -> None:
    if cfg is not None:  # what CP > 1 needs from the model (MoE, a2a's heads, windows): refused naming the key
        check_context_parallel_model(model, prefix, layout.cp, layout.tp,
                                     cp_comm_type(OmegaConf.select(cfg, f"{prefix}.megatron")),
                                     te_attention=str(cfg.trainer.device) != "cpu")
    try:
        check_parallel_fit(model, layout.tp, layout.pp, layout.vpp, ep=layout.ep, etp=layout.etp)
        if (layout.tp * layout.cp * layout.dp) % layout.expert_shards:
            raise ValueError(f"EP*ETP = {layout.expert_shards} does not divide the "
                             f"{layout.tp * layout.cp * layout.dp} ranks of a pipeline stage")
    except ValueError as err:
        raise PlanError(f"{prefix}.megatron (TP={layout.tp}, PP={layout.pp}, EP={layout.ep}) does not factor this "
                        f"model: {err}") from err


def _check_rollout_factors(model: HFModelConfig, tp: int) -> None:
    heads, groups = model.num_attention_heads, model.num_key_value_heads
    if heads % tp or (groups % tp and tp % groups):
        raise PlanError(f"{ROLLOUT}.tensor_model_parallel_size={tp} does not factor this model: the engine splits "
                        f"num_attention_heads={heads} over TP and needs num_key_value_heads={groups} to be a "
                        f"multiple or a divisor of TP")


def _sequence_length(cfg: DictConfig) -> int:
    response = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
    return cfg.data.max_prompt_length + response


class _PhaseTable:
    """Memory rows, each resident in some phases of a step and off the GPU (0 bytes) in the others."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        self.phases = phases
        self.rows: list[MemoryRow] = []
        self.notes: list[str] = []
        self.at_engine_start = 0.0  # bytes resident when the rollout engine starts (end of init_model)

    def add(self, label: str, nbytes: float, phases: tuple[str, ...], at_engine_start: float | None = None) -> None:
        """``at_engine_start``: what of the row exists when the engine starts (default: all of it when
        the row is resident during generation, else nothing)."""
        self.rows.append(MemoryRow(label, {p: (nbytes if p in phases else 0.0) for p in self.phases}))
        if at_engine_start is None:
            at_engine_start = nbytes if "generate" in phases else 0.0
        self.at_engine_start += at_engine_start


ROLE_PREFIX = {"actor": ACTOR, "critic": "critic"}
ROLE_MODEL = {"actor": "actor_rollout_ref.model", "critic": "critic.model"}


def _lora_dtype(lora: Any, params_dtype: str) -> str:
    """The adapters' dtype: lora.dtype, else the role's params dtype."""
    return {"float32": "fp32", "bfloat16": "bf16"}.get(str(lora.dtype), str(lora.dtype)) if lora.dtype else params_dtype


def _lora_trainable_stage_params(model: HFModelConfig, layout: Layout, stage: Stage, lora: Any, lm_head: bool) -> float:
    """Trainable parameters on one GPU of the stage: the adapters, and the critic's value head (hidden -> 1,
    trained in full, on the last stage)."""
    adapters = memory.lora_stage_params(model, layout, stage, lora.rank, lambda i: lora_targets(lora, i))
    value_head = model.hidden_size if not lm_head and (stage == "last" or layout.pp == 1) else 0
    return adapters + value_head


def lora_trainable_params(model: HFModelConfig, lora: Any) -> int:
    """Adapter parameters of the whole model (no TP split)."""
    return int(sum(sum(memory.lora_linear_params(model, linear, lora.rank))
                   for i in range(model.num_layers) for linear in lora_targets(lora, i)))


def _params_dtype(cfg: DictConfig, mcfg: DictConfig) -> str:
    if mcfg.params_dtype != "auto":
        return mcfg.params_dtype
    return "fp32" if cfg.trainer.device == "cpu" else "bf16"  # what "auto" picks on each device


def _tokens_per_micro_batch(role_cfg: DictConfig, micro: int, sequence_length: int, layout: Layout) -> int:
    """Tokens of a micro-batch at its longest, all CP ranks together, after the CP split's padding.

    Fixed micro-batches: ``micro`` sequences of prompt + response tokens, each padded to a multiple of
    2 CP m (memory.cp_padded_length; the padded length grows with the length, so full-length sequences are
    the most). Dynamic batching: the ``ppo_max_token_len_per_gpu`` cap per GPU, so CP x cap real tokens per
    micro-batch (workers/forward.pack_batch, as verl), plus the padding of the ceil(cap / sequence length)
    full-length sequences it holds (shorter sequences pad more per token)."""
    if role_cfg.use_dynamic_bsz:
        cap = role_cfg.ppo_max_token_len_per_gpu * layout.cp
        pad = memory.cp_padded_length(sequence_length, layout) - sequence_length
        return cap + -(-cap // sequence_length) * pad
    return micro * memory.cp_padded_length(sequence_length, layout)


def _cp_note(role: str, layout: Layout, sequence_length: int, tokens: int, kernel: str | None,
             comm: str | None) -> str:
    multiple = memory.cp_split_multiple(layout)
    return (f"{role}: CP {layout.cp}, {kernel} (cp_comm_type={comm or 'p2p'}): each sequence of a packed micro-batch "
            f"padded to a multiple of 2 x CP{' x TP' if layout.sequence_parallel else ''} = {multiple} tokens "
            f"({sequence_length} -> {memory.cp_padded_length(sequence_length, layout)}) and split into "
            f"{2 * layout.cp} chunks, 2 per CP rank: {tokens:,} tokens per micro-batch, {tokens // layout.cp:,} per rank")


def _trained_role_rows(table: _PhaseTable, cfg: DictConfig, role: str, role_sizes: RoleSizes,
                       model: HFModelConfig, stage: Stage) -> None:
    """Weights, grads, Adam state and activations of the actor or the critic at one pipeline stage."""
    prefix = ROLE_PREFIX[role]
    role_cfg = OmegaConf.select(cfg, prefix)
    mcfg = role_cfg.megatron
    layout = _layout(cfg, prefix, role_sizes.model_parallel_size * role_sizes.data_parallel_size)
    update_phase = f"{role} update"
    dtype = _params_dtype(cfg, mcfg)
    tcfg = transformer_config(cfg, prefix, model, layout, dtype)
    layout = dataclasses.replace(layout, sequence_parallel=bool(tcfg.sequence_parallel))
    per_param = memory.state_bytes_per_param(dtype, mcfg.use_distributed_optimizer, layout.dp * layout.cp)
    lm_head = role == "actor"  # the critic ends in a hidden -> 1 value head
    params = memory.stage_params(model, layout, stage, lm_head=lm_head)
    # Offload (workers/offload.py): with param_offload the actor's weights leave for generation (before the
    # engine starts, too) and come back for log-probs, the update and the weight export; the grads of both
    # roles live only in their update; with optimizer_offload so does Adam's state. The critic is not told
    # about generation: its weights stay.
    weights_phases = table.phases
    if mcfg.param_offload and role == "actor":
        weights_phases = tuple(p for p in table.phases if p != "generate")
    grads_phases = (update_phase,) if mcfg.param_offload else table.phases
    optim_phases = (update_phase,) if mcfg.optimizer_offload else table.phases
    shards = f", /{layout.dp * layout.cp} shards" if mcfg.use_distributed_optimizer else ""
    lora = OmegaConf.select(cfg, f"{ROLE_MODEL[role]}.lora", default=None)
    if lora_enabled(lora):  # issue 36: the base frozen in its dtype, adapters trained with their grads and Adam
        table.add(f"{role} weights ({dtype}, frozen)", params * per_param.params, weights_phases)
        trainable = _lora_trainable_stage_params(model, layout, stage, lora, lm_head)
        adapter_dtype = _lora_dtype(lora, dtype)
        per_adapter = memory.state_bytes_per_param(adapter_dtype, mcfg.use_distributed_optimizer, layout.dp * layout.cp)
        what = "adapters" if lm_head else "adapters + value head"
        table.add(f"{role} LoRA {what} (rank {lora.rank}, {adapter_dtype})", trainable * per_adapter.params,
                  weights_phases)
        table.add(f"{role} grads (fp32, {what})", trainable * per_adapter.grads, grads_phases)
        table.add(f"{role} optimizer (Adam, {what}{shards})", trainable * per_adapter.optimizer, optim_phases,
                  at_engine_start=trainable * per_adapter.optimizer_at_start if "generate" in optim_phases else 0.0)
    else:
        _full_state_rows(table, role, dtype, params, per_param, model, layout, stage, mcfg, shards, weights_phases,
                         grads_phases, optim_phases)
    _activation_rows(table, cfg, role, role_cfg, role_sizes, model, layout, stage, tcfg, dtype, lm_head, lora)


def _full_state_rows(table: _PhaseTable, role: str, dtype: str, params: int, per_param, model: HFModelConfig,
                     layout: Layout, stage: Stage, mcfg: DictConfig, shards: str, weights_phases, grads_phases,
                     optim_phases) -> None:
    """Full fine-tuning: weights, grads and Adam state of every parameter."""
    table.add(f"{role} weights ({dtype})", params * per_param.params, weights_phases)
    table.add(f"{role} grads (fp32)", params * per_param.grads, grads_phases)
    # MoE: the experts' Adam state is sharded over the expert-DP group only; the experts of this stage (a
    # dense-first model's first stage holds fewer)
    experts = memory.stage_expert_params(model, layout, stage)
    expert_dp = memory.expert_data_parallel(layout)
    per_expert = memory.state_bytes_per_param(dtype, mcfg.use_distributed_optimizer, expert_dp)
    if experts and mcfg.use_distributed_optimizer:
        shards += f", experts /{expert_dp}"
    optimizer = (params - experts) * per_param.optimizer + experts * per_expert.optimizer
    at_start = (params - experts) * per_param.optimizer_at_start + experts * per_expert.optimizer_at_start
    table.add(f"{role} optimizer (Adam{shards})", optimizer, optim_phases,
              at_engine_start=at_start if "generate" in optim_phases else 0.0)
    # (m, v come at the first step, after the engine has sized itself)


def _activation_rows(table: _PhaseTable, cfg: DictConfig, role: str, role_cfg: DictConfig, role_sizes: RoleSizes,
                     model: HFModelConfig, layout: Layout, stage: Stage, tcfg: Any, dtype: str, lm_head: bool,
                     lora: Any) -> None:
    mcfg = role_cfg.megatron
    update_phase = f"{role} update"
    tokens = _tokens_per_micro_batch(role_cfg, role_sizes.micro_batch_size, _sequence_length(cfg), layout)
    act = memory.activation_bytes(model, layout, tokens, role_sizes.grad_accumulation_steps, stage,
                                  _recompute(tcfg))
    if lm_head and (stage == "last" or layout.pp == 1):
        act += memory.logits_bytes(model, layout, tokens)
    table.add(f"{role} activations", act, (update_phase,))
    if lora_enabled(lora):
        # the LoRA path of the layer with the most adapters (a simple model: docs/launching.md, LoRA)
        per_stage = model.num_layers // layout.pp
        first = 0 if (stage == "first" or layout.pp == 1) else (layout.pp - 1) * per_stage
        per_token_layer = max(memory.lora_activation_bytes_per_token_layer(
            model, layout, lora.rank, float(lora.dropout), lora_targets(lora, i),
            memory.FP32 if dtype in ("fp32", "float32") else memory.BF16, bool(tcfg.sequence_parallel))
            for i in range(first, first + per_stage))
        table.add(f"{role} LoRA activations", memory.lora_activation_bytes(
            model, layout, tokens, role_sizes.grad_accumulation_steps, stage, per_token_layer, _recompute(tcfg)),
            (update_phase,))
    if layout.cp > 1:
        # CP attention (issue 35): Transformer Engine's with the TransformerConfig's cp_comm_type on CUDA
        comm = tcfg.cp_comm_type
        cp_kernel = memory.cp_attention_kernel(layout.cp, comm)
        stored, transient = memory.cp_attention_bytes(cp_kernel, model, layout, tokens,
                                                      role_sizes.grad_accumulation_steps, stage, _recompute(tcfg))
        table.add(f"{role} CP attention ({cp_kernel})", stored + transient, (update_phase,))
        table.notes.append(_cp_note(role, layout, _sequence_length(cfg), tokens, cp_kernel, comm))
        return
    # the attention kernel that runs (models/attention.py), if it keeps more than flash does (issue 32)
    kernel = memory.attention_kernel(
        packed=bool(mcfg.packed_sequences), shared_prompts=bool(mcfg.share_prompts), dtype=dtype,
        dropout=float(tcfg.attention_dropout), q_heads=model.num_attention_heads,
        kv_heads=model.num_key_value_heads, head_dim=model.head_dim, tp=layout.tp, window=bool(model.sliding_window))
    kernel_bytes = memory.attention_kernel_bytes(kernel, model, layout, tokens, _sequence_length(cfg),
                                                 role_sizes.grad_accumulation_steps, stage, _recompute(tcfg))
    if kernel_bytes:
        table.add(f"{role} attention kernel ({kernel})", kernel_bytes, (update_phase,))


def _build_table(cfg: DictConfig, sizes: DerivedSizes, model: HFModelConfig, critic_model: HFModelConfig,
                 stage: Stage) -> _PhaseTable:
    """Every row but the rollout engine's, which is sized on what these leave free (_add_engine)."""
    phases = ("generate",) + _sync_phase(cfg) + ("actor update",) + (("critic update",) if sizes.uses_critic else ())
    table = _PhaseTable(phases)
    _trained_role_rows(table, cfg, "actor", sizes.actor, model, stage)
    if sizes.uses_critic:
        # The critic's first stage is its busiest: the embedding and the most micro-batches in flight.
        _trained_role_rows(table, cfg, "critic", sizes.critic, critic_model, "first")
    kl = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    if kl and lora_enabled(cfg.actor_rollout_ref.model.lora):
        table.notes.append("reference: the actor with its LoRA adapters off (no reference model, no weights of its "
                           "own; actor_rollout_ref.ref.megatron is not used)")
    elif kl:
        ref_mcfg = cfg.actor_rollout_ref.ref.megatron
        ref_layout = _layout(cfg, REF, sizes.world_size)
        ref_params = max(memory.stage_params(model, ref_layout, s) for s in ("first", "last"))
        dtype = _params_dtype(cfg, ref_mcfg)
        per_param = memory.state_bytes_per_param(dtype, False, 1).params
        # offloaded for generation, back only for its own log-probs (not for the actor's weight export)
        ref_phases = tuple(p for p in phases if p not in ("generate", "weight sync")) if ref_mcfg.param_offload else phases
        table.add(f"ref weights ({dtype})", ref_params * per_param, ref_phases)
        transformer_config(cfg, REF, model, ref_layout, dtype)  # the reference's overrides, checked before launch
    table.add("reserved (CUDA context, NCCL, fragmentation)", cfg.plan.reserved_gib * GIB, phases)
    return table


def _add_engine(table: _PhaseTable, cfg: DictConfig, rollout: RolloutShare) -> None:
    if cfg.actor_rollout_ref.rollout.mode == "colocated":
        # The engine gives its weights and KV cache back during updates only with free_cache_engine; what its
        # sleep keeps (vLLM's CUDA graphs) stays in every phase.
        asleep = rollout.memory.asleep
        engine_phases = ("generate",) if cfg.actor_rollout_ref.rollout.free_cache_engine else table.phases
        table.add("rollout engine (weights + KV)", rollout.reserved - asleep, engine_phases, at_engine_start=0.0)
        if "weight sync" in table.phases and cfg.actor_rollout_ref.rollout.free_cache_engine:
            # resumed weights, KV cache not yet (the order verl and slime use)
            table.rows[-1].per_phase["weight sync"] = rollout.weights
        if asleep:
            table.add("rollout engine kept asleep (CUDA graphs)", asleep, table.phases, at_engine_start=0.0)


def _sync_phase(cfg: DictConfig) -> tuple[str, ...]:
    """With the actor's param_offload, its weights come back to the GPU for the export while the engine's
    weights are resumed: a phase of its own ("weight sync"), which generation's numbers would hide."""
    colocated = cfg.actor_rollout_ref.rollout.mode == "colocated"
    return ("weight sync",) if colocated and cfg.actor_rollout_ref.actor.megatron.param_offload else ()


def _rollout_share(cfg: DictConfig, model: HFModelConfig, world: int, gpu_memory: float, held: float) -> RolloutShare:
    """The engine's share of one GPU, by its own meaning of rollout.gpu_memory_utilization (rollout/memory.py):
    SGLang's fraction of the memory free when it starts, vLLM's fraction of the total. ``held``: what is in use
    when it starts; colocated, the actor (weights, grads, fp32 master weights) and the reference, which
    workers/hybrid.py builds first, and plan.reserved_gib."""
    rcfg = cfg.actor_rollout_ref.rollout
    tp = rcfg.tensor_model_parallel_size
    _check_rollout_factors(model, tp)
    start = EngineStart(total=gpu_memory, held=held, weights=memory.rollout_weight_bytes(model, tp),
                        fraction=float(rcfg.gpu_memory_utilization), model=model, tp=tp,
                        max_num_seqs=int(rcfg.max_num_seqs), max_num_batched_tokens=int(rcfg.max_num_batched_tokens),
                        enforce_eager=bool(rcfg.enforce_eager))
    mem = engine_of(rcfg).memory(start)
    if mem.refusal is not None:
        raise PlanError(mem.refusal)
    kv_tokens = int(max(mem.kv_cache, 0.0) // memory.kv_cache_bytes_per_token(model, tp))
    # The same function the workers build their engines with (rollout/mesh.py), on the launchers' rank layout.
    engines = build_rollout_mesh(default_places(world, cfg.trainer.n_gpus_per_node), tp).num_engines
    seq = _sequence_length(cfg)
    if kv_tokens < seq:
        raise PlanError(
            f"{ROLLOUT}.gpu_memory_utilization={rcfg.gpu_memory_utilization} reserves that fraction of the "
            f"{_gib(mem.base)} GiB per GPU {mem.base_label} ({mem.engine}: {mem.meaning}) = {_gib(mem.budget)} GiB, "
            f"but at {ROLLOUT}.tensor_model_parallel_size={tp} the engine's weights take {_gib(start.weights)} GiB, "
            f"leaving KV cache for {kv_tokens} tokens: less than one sequence of {seq} (prompt + response); "
            f"raise gpu_memory_utilization or the rollout TP")
    return RolloutShare(engines=engines, tp=tp, memory=mem, kv_tokens=kv_tokens)


def _plan(cfg: DictConfig) -> Plan:
    """The plan at the busiest actor stage, fitting or not."""
    sizes = validate(cfg)
    model = load_model_facts(cfg)
    world = sizes.world_size
    actor_layout = _layout(cfg, ACTOR, world)
    roles = context_parallel_roles(cfg, sizes.uses_critic)
    _check_factors(model, ACTOR, actor_layout, cfg)
    check_lora_model(model, "actor_rollout_ref.model", cfg.actor_rollout_ref.model.lora)
    if REF in roles:
        _check_factors(model, REF, _layout(cfg, REF, world), cfg)
    elif lora_enabled(cfg.actor_rollout_ref.model.lora):
        pass  # the reference is the actor with its adapters off: no layout of its own
    else:
        _check_factors(model, REF, _layout(cfg, REF, world), None)
    critic_model = model
    if sizes.uses_critic:
        if not OmegaConf.is_missing(cfg.critic.model, "path"):  # else the critic starts from the actor's model
            critic_model = load_model_facts(cfg, "critic.model")
        _check_factors(critic_model, "critic", _layout(cfg, "critic", world), cfg)
        check_lora_model(critic_model, "critic.model", cfg.critic.model.lora)
    gpu_memory = cfg.plan.gpu_memory_gib * GIB
    candidates = []
    for stage in (("first", "last") if actor_layout.pp > 1 else ("first",)):
        table = _build_table(cfg, sizes, model, critic_model, stage)
        # Server mode: the engine has its GPU to itself.
        held = table.at_engine_start if cfg.actor_rollout_ref.rollout.mode == "colocated" else 0.0
        rollout = _rollout_share(cfg, model, world, gpu_memory, held)
        _add_engine(table, cfg, rollout)
        candidates.append(Plan(sizes, model, gpu_memory, actor_layout, stage, table.phases, tuple(table.rows),
                               rollout, _sequence_length(cfg), tuple(table.notes)))
    return max(candidates, key=lambda p: p.total(p.peak_phase()))


def _without_lora(cfg: DictConfig) -> DictConfig:
    """The same config with LoRA off for the actor and the critic: full fine-tuning."""
    full = copy.deepcopy(cfg)
    OmegaConf.set_readonly(full, False)
    for key in ("actor_rollout_ref.model.lora", "critic.model.lora"):
        if OmegaConf.select(full, key, default=None) is not None:
            OmegaConf.update(full, key, OmegaConf.structured(LoRAConfig()), merge=False)
    return full


def _lora_notes(cfg: DictConfig, plan: Plan) -> tuple[str, ...]:
    """With LoRA: the trainable parameters, and the saving against full fine-tuning (the same config with rank 0)."""
    notes = []
    for role, key, label in (("actor", "actor_rollout_ref.model.lora", "actor"),
                             ("critic", "critic.model.lora", "critic")):
        lora = OmegaConf.select(cfg, key, default=None)
        if not lora_enabled(lora) or (role == "critic" and not plan.sizes.uses_critic):
            continue
        model = plan.model if role == "actor" or OmegaConf.is_missing(cfg.critic.model, "path") else \
            load_model_facts(cfg, "critic.model")
        total = memory.total_params(model)
        trainable = lora_trainable_params(model, lora) + (model.hidden_size if role == "critic" else 0)
        targets = sorted({t for i in range(model.num_layers) for t in lora_targets(lora, i)},
                         key=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2").index)
        extra = "; the value head (hidden -> 1) is trained in full" if role == "critic" else ""
        notes.append(f"{label} LoRA rank {lora.rank} (alpha {float(lora.alpha or 16):g}, scale "
                     f"{float(lora.alpha or 16) / lora.rank:g}) on {', '.join(targets)}: trainable "
                     f"{_count(trainable)} params ({100 * trainable / total:.2f}% of {_count(total)}); the base is "
                     f"frozen: no grads, no Adam state{extra}")
    if not notes:
        return ()
    try:
        full = _plan(_without_lora(cfg))
    except ConfigError as err:
        return (*notes, f"vs full fine-tuning: it does not run ({str(err).splitlines()[0]})")
    def state(p: Plan, role: str) -> float:
        phase = f"{role} update"
        return sum(r.per_phase.get(phase, 0.0) for r in p.rows if r.label.startswith(f"{role} ")
                   and "activations" not in r.label and "attention" not in r.label)
    update = "actor update"
    peak, full_peak = plan.peak_phase(), full.peak_phase()
    notes.append(
        f"vs full fine-tuning, per GPU: actor weights + grads + Adam {_gib(state(full, 'actor'))} -> "
        f"{_gib(state(plan, 'actor'))} GiB; update {_gib(full.total(update))} GiB -> {_gib(plan.total(update))} GiB; "
        f"peak {_gib(full.total(full_peak))} GiB ({full_peak}) -> {_gib(plan.total(peak))} GiB ({peak}); "
        f"KV cache per engine {full.rollout.kv_tokens:,} -> {plan.rollout.kv_tokens:,} tokens")
    return tuple(notes)


# issue 39: below this hidden size a model-parallel split is slower than none. Splitting a layer over TP ranks adds
# all-reduces of the micro-batch's tokens x hidden activations (2 forward, 2 backward per layer) while each rank's
# matmuls shrink to tokens x hidden^2 / TP: the compute per byte sent grows with the hidden size, and below ~1k a
# layer's matmuls take less time than its collectives (measured on CPU: the tiny preset's 64-wide 2-layer model ran
# 3.2x slower a step at TP=2 on two Ray ranks than at TP=1 on one rank with shared prompts, benchmarks/README.md).
# PP and CP add their own sends alike.
SPLIT_MIN_HIDDEN = 1024
_SPLIT_KEYS = (("tensor_model_parallel_size", "tp"), ("pipeline_model_parallel_size", "pp"),
               ("context_parallel_size", "cp"))


def slower_layout_note(cfg: DictConfig, plan: Plan) -> Optional[str]:
    """A note when the actor's model-parallel split (TP, PP or CP > 1) is slower than no split would be: the model
    is narrower than SPLIT_MIN_HIDDEN and the same job with TP = PP = CP = 1 fits in plan.gpu_memory_gib. None
    otherwise (a wide model, no split, or one that needs the split to fit)."""
    split = {key: getattr(plan.actor_layout, attr) for key, attr in _SPLIT_KEYS
             if getattr(plan.actor_layout, attr) > 1}
    if not split or plan.model.hidden_size >= SPLIT_MIN_HIDDEN:
        return None
    unsplit = copy.deepcopy(cfg)
    megatron = unsplit.actor_rollout_ref.actor.megatron
    for key in split:
        megatron[key] = 1
    megatron.virtual_pipeline_model_parallel_size = None
    megatron.sequence_parallel = False
    try:
        other = _plan(unsplit)
    except ConfigError:
        return None  # the unsplit job does not run at all: the split is needed
    if not other.fits:
        return None
    keys = " ".join(f"actor_rollout_ref.actor.megatron.{key}=1" for key in split)
    on_cpu = cfg.trainer.device == "cpu" and plan.sizes.world_size > 1
    fewer = ("; on CPU one rank is faster still (trainer.nnodes=1 trainer.n_gpus_per_node=1: in the driver's "
             "process, no Ray)" if on_cpu else "")
    return (f"note: slower than a smaller layout: the actor splits a model of hidden size {plan.model.hidden_size} "
            f"(< {SPLIT_MIN_HIDDEN}) over " + ", ".join(f"{key}={value}" for key, value in split.items())
            + f": each layer's matmuls take less time than the collectives the split adds; unsplit it still fits "
            f"(peak {_gib(other.total(other.peak_phase()))} of {_gib(plan.gpu_memory)} GiB per GPU): {keys}{fewer} (docs/launching.md, "
            f"'Layouts slower than a smaller one')")


def build_plan(cfg: DictConfig) -> Plan:
    """Resolve sizes and memory per GPU; raise ConfigError/PlanError naming the key when it cannot run."""
    plan = _plan(cfg)
    lora_notes = _lora_notes(cfg, plan)
    if lora_notes:
        plan = dataclasses.replace(plan, notes=plan.notes + lora_notes)
    slower = slower_layout_note(cfg, plan) if plan.fits else None
    if slower is not None:
        plan = dataclasses.replace(plan, notes=plan.notes + (slower,))
    if not plan.fits:
        raise PlanError(
            f"the plan does not fit in {cfg.plan.gpu_memory_gib} GiB per GPU (plan.gpu_memory_gib):\n{plan.format()}\n"
            f"options: more nodes (the distributed optimizer shards Adam over DP), a larger TP or PP, a smaller "
            f"ppo_micro_batch_size_per_gpu, megatron.override_transformer_config.recompute_granularity=full "
            f"(with recompute_method and recompute_num_layers), megatron.param_offload / optimizer_offload "
            f"(state off the GPU while generating), or a lower {ROLLOUT}.gpu_memory_utilization")
    return plan


def _distributed_optimizer_keys(cfg: DictConfig) -> list[str]:
    sizes = validate(cfg)
    prefixes = [ACTOR] + (["critic"] if sizes.uses_critic else [])
    return [f"{p}.megatron.use_distributed_optimizer" for p in prefixes
            if OmegaConf.select(cfg, f"{p}.megatron.use_distributed_optimizer")]


def plan_without_distributed_optimizer(cfg: DictConfig, keys: list[str]) -> str:
    """The plan with ``keys`` set to false, formatted (or why that one does not run either)."""
    without = copy.deepcopy(cfg)
    OmegaConf.set_readonly(without, False)
    for key in keys:
        OmegaConf.update(without, key, False)
    try:
        return build_plan(without).format()
    except ConfigError as err:
        return f"that does not run either: {err}"


def distributed_optimizer_problem(cfg: DictConfig) -> Optional[str]:
    """Why this environment cannot give the distributed optimizer the config asks for, with the plan
    without it; None when it is not asked for or is available."""
    from megatron_rl.models.capabilities import distributed_optimizer_blocker

    keys = _distributed_optimizer_keys(cfg)
    blocker = distributed_optimizer_blocker() if keys else None
    if blocker is None:
        return None
    return (f"{' and '.join(f'{k}=true' for k in keys)} {blocker}. Install megatron-rl[gpu] (Transformer Engine) "
            f"or set {' and '.join(f'{k}=false' for k in keys)}; without it the plan is:\n"
            f"{plan_without_distributed_optimizer(cfg, keys)}")


def check_launch(cfg: DictConfig) -> None:
    """What only the launching environment can tell, checked before any worker starts (train.py): a
    distributed optimizer asked for but not available here is refused with the reason and the plan
    without it (the engine would refuse it too, after minutes of start-up); on GPUs, a rollout engine that
    would refuse to start on the memory free when it starts (rollout/memory.py)."""
    problem = distributed_optimizer_problem(cfg)
    if problem is not None:
        raise PlanError(problem)
    from megatron_rl.distributed.device import rollout_on_cpu

    if not rollout_on_cpu(cfg):  # the run's device, as the engines will see it
        # the engine's own start-up memory check (vLLM refuses when less than its share of the total is free) on
        # the memory the plan has in use when the engine starts: refused here, not after the workers built the actor
        _plan(cfg)
    for prefix in (ACTOR, REF, "critic"):
        given = dict(OmegaConf.select(cfg, f"{prefix}.megatron.override_transformer_config", default=None) or {})
        kernels = te_kernel_flags(given)
        if kernels and not _transformer_engine_here():
            raise PlanError(f"{prefix}.megatron.override_transformer_config sets {kernels}: fused kernels of "
                            "Transformer Engine, which does not import here; install megatron-rl[gpu] or set them "
                            "false")
        if given.get("moe_grouped_gemm") is True:  # TE imports, but the run's device may still be the CPU
            from megatron_rl.models.moe_experts import choose_expert_layer

            try:
                choose_expert_layer(True, cuda=str(cfg.trainer.device) != "cpu", te=_transformer_engine_here(),
                                    key=f"{prefix}.megatron.override_transformer_config.moe_grouped_gemm")
            except ValueError as err:
                raise PlanError(str(err)) from None
        deepep = [k for k in ("moe_enable_deepep", "moe_token_dispatcher_type") if k in given and
                  (given[k] is True or given[k] == "flex")]
        if deepep and not _importable("deep_ep"):
            raise PlanError(f"{prefix}.megatron.override_transformer_config sets "
                            f"{', '.join(f'{k}={given[k]}' for k in deepep)}: Megatron's flex dispatcher runs on "
                            "DeepEP (CUDA), which does not import here; install deep_ep on the GPU nodes, or drop them "
                            "(the alltoall dispatcher gives the same numbers)")


def _stage_save_host_bytes(model: HFModelConfig, layout: Layout, stage: Stage, lm_head: bool, dtype: str,
                           dist_opt: bool, kind: str) -> float:
    """Host RAM at save for one stage's Adam state: an MoE model's experts are sharded over expert-DP, the rest
    over DP x CP (as the optimizer rows count them)."""
    experts = memory.stage_expert_params(model, layout, stage)
    dense = memory.stage_params(model, layout, stage, lm_head=lm_head) - experts
    return (memory.checkpoint_save_host_bytes(dense, dtype, dist_opt, layout.dp * layout.cp, kind)
            + memory.checkpoint_save_host_bytes(experts, dtype, dist_opt, memory.expert_data_parallel(layout), kind))


def checkpoint_host_ram(cfg: DictConfig) -> str:
    """Host RAM per rank for the Adam state while a trained role's checkpoint is saved (issue 32): now
    (``fully_sharded_model_space``) and what the ``fully_reshardable`` gather of older saves took."""
    from megatron_rl.workers.checkpoint import LEGACY_OPTIMIZER_SHARDING_TYPE, OPTIMIZER_SHARDING_TYPE

    sizes = validate(cfg)
    model = load_model_facts(cfg)
    lines = []
    for role in ("actor",) + (("critic",) if sizes.uses_critic else ()):
        prefix = ROLE_PREFIX[role]
        mcfg = OmegaConf.select(cfg, prefix).megatron
        critic_model = model
        if role == "critic" and not OmegaConf.is_missing(cfg.critic.model, "path"):
            critic_model = load_model_facts(cfg, "critic.model")
        role_model = model if role == "actor" else critic_model
        layout = _layout(cfg, prefix, sizes.world_size)
        dtype = _params_dtype(cfg, mcfg)
        dist_opt = bool(mcfg.use_distributed_optimizer)
        lora = OmegaConf.select(cfg, f"{ROLE_MODEL[role]}.lora", default=None)
        if lora_enabled(lora):  # the Adam state of the adapters (and the critic's value head) only
            params = max(_lora_trainable_stage_params(role_model, layout, s, lora, role == "actor")
                         for s in ("first", "last"))
            dtype = _lora_dtype(lora, dtype)
            now, old = (memory.checkpoint_save_host_bytes(params, dtype, dist_opt, layout.dp * layout.cp, kind)
                        for kind in (OPTIMIZER_SHARDING_TYPE, LEGACY_OPTIMIZER_SHARDING_TYPE))
        else:
            now, old = (max(_stage_save_host_bytes(role_model, layout, s, role == "actor", dtype, dist_opt, kind)
                            for s in ("first", "last"))
                        for kind in (OPTIMIZER_SHARDING_TYPE, LEGACY_OPTIMIZER_SHARDING_TYPE))
        lines.append(f"checkpoint save, host RAM per rank for the {role}'s Adam state: {_gib(now)} GiB "
                     f"({OPTIMIZER_SHARDING_TYPE if dist_opt else 'no distributed optimizer'}; the "
                     f"{LEGACY_OPTIMIZER_SHARDING_TYPE} gather of older saves: {_gib(old)} GiB)")
    return "\n".join(lines)


def print_plan(cfg: DictConfig, title: Optional[str] = None) -> Plan:
    """Print the plan (what ``--dry-run`` shows) and return it; raises PlanError when it cannot run.

    The plan is of the target cluster; what this environment lacks for it (TE/Apex for the distributed
    optimizer) is printed as a note, and a real start from here is refused (``check_launch``)."""
    plan = build_plan(cfg)
    if title:
        print(title)
    print(plan.format())
    from megatron_rl.plan.traffic import plan_sync_traffic  # issue 16: the weight-sync traffic model

    print(plan_sync_traffic(cfg, plan))
    print(checkpoint_host_ram(cfg))
    problem = distributed_optimizer_problem(cfg)
    if problem is not None:
        print(f"note: a start from this environment is refused: {problem}")
    return plan
