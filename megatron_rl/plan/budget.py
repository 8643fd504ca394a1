"""Memory per GPU, row by row and phase by phase of a step: each trained role's weights, grads, Adam state and
activations, the reference's weights, the reserve, and the rollout engine's share."""
from __future__ import annotations

import dataclasses

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_rl.config.distillation_schema import served_teacher
from megatron_rl.config.lora import lora_enabled, lora_targets
from megatron_rl.config.optimizer_overrides import HostAdam, host_adam
from megatron_rl.config.schema import ActorConfig, CriticConfig, LoRAConfig, MegatronParallelConfig, PPOTrainerConfig
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.plan import lora_memory, memory, vision
from megatron_rl.plan.layout import (
    REF,
    ROLE_PREFIX,
    params_dtype,
    recompute_of,
    role_layout,
    role_model,
    trained_role,
    transformer_config,
)
from megatron_rl.plan.accuracy import ACTIVATIONS, EXACT, RowError
from megatron_rl.plan.lora import lora_dtype, lora_expert_stage_params, lora_trainable_stage_params
from megatron_rl.plan.memory import Layout, Stage, StateBytesPerParam
from megatron_rl.plan.report import GIB, MemoryRow, RolloutShare
from megatron_rl.plan.validate import DerivedSizes, RoleSizes

class PhaseTable:
    """Memory rows, each resident in some phases of a step and off the GPU (0 bytes) in the others."""

    def __init__(self, phases: tuple[str, ...]) -> None:
        self.phases = phases
        self.rows: list[MemoryRow] = []
        self.notes: list[str] = []
        self.at_engine_start = 0.0  # bytes resident when the rollout engine starts (end of init_model)

    def add(self, label: str, nbytes: float, phases: tuple[str, ...], at_engine_start: float | None = None,
            accuracy: RowError = EXACT) -> None:
        """``at_engine_start``: what of the row exists when the engine starts (default: all of it when
        the row is resident during generation, else nothing); ``accuracy``: how far the row can be off."""
        self.rows.append(MemoryRow(label, {p: (nbytes if p in phases else 0.0) for p in self.phases}, accuracy.error))
        if at_engine_start is None:
            at_engine_start = nbytes if "generate" in phases else 0.0
        self.at_engine_start += at_engine_start


def sequence_length(cfg: PPOTrainerConfig) -> int:
    response = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
    return cfg.data.max_prompt_length + response


def _tokens_per_micro_batch(role_cfg: ActorConfig | CriticConfig, micro: int, length: int, layout: Layout) -> int:
    """Tokens of a micro-batch at its longest, all CP ranks together, after the CP split's padding.

    Fixed micro-batches: ``micro`` sequences of prompt + response tokens, each padded to a multiple of
    2 CP m (memory.cp_padded_length; the padded length grows with the length, so full-length sequences are
    the most). Dynamic batching: the ``ppo_max_token_len_per_gpu`` cap per GPU, so CP x cap real tokens per
    micro-batch (workers/forward.pack_batch, as verl), plus the padding of the ceil(cap / sequence length)
    full-length sequences it holds (shorter sequences pad more per token)."""
    if role_cfg.use_dynamic_bsz:
        cap = role_cfg.ppo_max_token_len_per_gpu * layout.cp
        pad = memory.cp_padded_length(length, layout) - length
        return cap + -(-cap // length) * pad
    return micro * memory.cp_padded_length(length, layout)


def _cp_note(role: str, layout: Layout, length: int, tokens: int, kernel: str | None, comm: str | None) -> str:
    multiple = memory.cp_split_multiple(layout)
    return (f"{role}: CP {layout.cp}, {kernel} (cp_comm_type={comm or 'p2p'}): each sequence of a packed micro-batch "
            f"padded to a multiple of 2 x CP{' x TP' if layout.sequence_parallel else ''} = {multiple} tokens "
            f"({length} -> {memory.cp_padded_length(length, layout)}) and split into "
            f"{2 * layout.cp} chunks, 2 per CP rank: {tokens:,} tokens per micro-batch, {tokens // layout.cp:,} per rank")


def _trained_role_rows(table: PhaseTable, cfg: PPOTrainerConfig, role: str, role_sizes: RoleSizes,
                       model: HFModelConfig, stage: Stage) -> None:
    """Weights, grads, Adam state and activations of the actor or the critic at one pipeline stage."""
    role_cfg = trained_role(cfg, role)
    mcfg = role_cfg.megatron
    layout = role_layout(cfg, ROLE_PREFIX[role], role_sizes.model_parallel_size * role_sizes.data_parallel_size)
    update_phase = f"{role} update"
    dtype = params_dtype(cfg, mcfg)
    tcfg = transformer_config(cfg, ROLE_PREFIX[role], model, layout, dtype)
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
    host = host_adam(role_cfg.optim)  # Megatron's CPU Adam: a share of Adam's state in host memory
    lora = role_model(cfg, role).lora
    if lora_enabled(lora):  # issue 36: the base frozen in its dtype, adapters trained with their grads and Adam
        table.add(f"{role} weights ({dtype}, frozen)", params * per_param.params, weights_phases)
        trainable = lora_trainable_stage_params(model, layout, stage, lora, lm_head)
        # MoE: the routed experts' adapters are expert-parallel, their Adam state sharded over expert-DP
        experts = lora_expert_stage_params(model, layout, stage, lora)
        adapter_dtype = lora_dtype(lora, dtype)
        per_adapter = memory.state_bytes_per_param(adapter_dtype, mcfg.use_distributed_optimizer, layout.dp * layout.cp)
        optimizer, at_start, shards = _adam_bytes(trainable, experts, adapter_dtype, mcfg, layout, shards, host)
        what = "adapters" if lm_head else "adapters + value head"
        table.add(f"{role} LoRA {what} (rank {lora.rank}, {adapter_dtype})", trainable * per_adapter.params,
                  weights_phases)
        table.add(f"{role} grads (fp32, {what})", trainable * per_adapter.grads, grads_phases)
        table.add(f"{role} optimizer (Adam, {what}{shards})", optimizer, optim_phases,
                  at_engine_start=at_start if "generate" in optim_phases else 0.0)
    else:
        # actor.freeze_vision_tower: the vision tower's weights only (no grads, no Adam state)
        frozen = memory.stage_vision_params(model, layout, stage) if getattr(role_cfg, "freeze_vision_tower",
                                                                             False) else 0
        if frozen:
            table.add(f"{role} vision tower ({dtype}, frozen)", frozen * per_param.params, weights_phases)
        _full_state_rows(table, role, dtype, params - frozen, per_param, model, layout, stage, mcfg, shards,
                         weights_phases, grads_phases, optim_phases, host)
    _activation_rows(table, cfg, role, role_cfg, role_sizes, model, layout, stage, tcfg, dtype, lm_head, lora)


def _full_state_rows(table: PhaseTable, role: str, dtype: str, params: int, per_param: StateBytesPerParam,
                     model: HFModelConfig, layout: Layout, stage: Stage, mcfg: MegatronParallelConfig, shards: str,
                     weights_phases: tuple[str, ...], grads_phases: tuple[str, ...],
                     optim_phases: tuple[str, ...], host: HostAdam = HostAdam()) -> None:
    """Full fine-tuning: weights, grads and Adam state of every parameter."""
    table.add(f"{role} weights ({dtype})", params * per_param.params, weights_phases)
    table.add(f"{role} grads (fp32)", params * per_param.grads, grads_phases)
    # MoE: the experts of this stage (a dense-first model's first stage holds fewer)
    experts = memory.stage_expert_params(model, layout, stage)
    optimizer, at_start, shards = _adam_bytes(params, experts, dtype, mcfg, layout, shards, host)
    table.add(f"{role} optimizer (Adam{shards})", optimizer, optim_phases,
              at_engine_start=at_start if "generate" in optim_phases else 0.0)
    # (m, v come at the first step, after the engine has sized itself)


def _adam_bytes(params: float, experts: float, dtype: str, mcfg: MegatronParallelConfig, layout: Layout,
                shards: str, host: HostAdam = HostAdam()) -> tuple[float, float, str]:
    """Adam state of ``params`` trained parameters on one GPU, ``experts`` of them expert-parallel (MoE experts or
    their LoRA adapters): the distributed optimizer shards the others over DP x CP and the experts' over the
    expert-DP group only. Returns (bytes, bytes that exist when the engine starts, the row's shards label).
    ``host``: with Megatron's CPU Adam (optim.override_optimizer_config) its share of the state (master weights, m,
    v; m, v only without the precision-aware optimizer) is in host memory, not on the GPU; the label says so."""
    dense = memory.state_bytes_per_param(dtype, mcfg.use_distributed_optimizer, layout.dp * layout.cp)
    expert_dp = memory.expert_data_parallel(layout)
    per_expert = memory.state_bytes_per_param(dtype, mcfg.use_distributed_optimizer, expert_dp)
    if experts and mcfg.use_distributed_optimizer:
        shards += f", experts /{expert_dp}"
    optimizer = (params - experts) * dense.optimizer + experts * per_expert.optimizer
    at_start = (params - experts) * dense.optimizer_at_start + experts * per_expert.optimizer_at_start
    # (at_start is the master weights: what the GPU keeps of them is host.gpu_bytes(master, master))
    return host.gpu_bytes(optimizer, at_start), host.gpu_bytes(at_start, at_start), shards + host.label()


def _activation_rows(table: PhaseTable, cfg: PPOTrainerConfig, role: str, role_cfg: ActorConfig | CriticConfig,
                     role_sizes: RoleSizes, model: HFModelConfig, layout: Layout, stage: Stage,
                     tcfg: TransformerConfig, dtype: str, lm_head: bool, lora: LoRAConfig) -> None:
    mcfg = role_cfg.megatron
    update_phase = f"{role} update"
    tokens = _tokens_per_micro_batch(role_cfg, role_sizes.micro_batch_size, sequence_length(cfg), layout)
    act = memory.activation_bytes(model, layout, tokens, role_sizes.grad_accumulation_steps, stage,
                                  recompute_of(tcfg))
    if lm_head and (stage == "last" or layout.pp == 1):
        act += memory.logits_bytes(model, layout, tokens)
    table.add(f"{role} activations", act, (update_phase,), accuracy=ACTIVATIONS)
    if model.vision is not None and (stage == "first" or layout.pp == 1) and not getattr(
            role_cfg, "freeze_vision_tower", False):  # frozen, the tower keeps nothing for a backward
        # the micro-batch's samples (full-length ones: tokens / sequence length, at least one), each with the
        # most patches its images can have (plan/vision.py patches_per_sample)
        samples = max(1.0, tokens / layout.cp / sequence_length(cfg))
        patches = vision.patches_per_sample(model.vision, vision.max_pixels(getattr(cfg.data, "mm_processor_kwargs",
                                                                                    None)), cfg.data.max_prompt_length)
        in_flight = memory.micro_batches_in_flight(layout, role_sizes.grad_accumulation_steps, stage)
        table.add(f"{role} vision tower activations ({patches:,} patches per sample at most)",
                  vision.vision_activation_bytes(model.vision, samples, patches, in_flight), (update_phase,),
                  accuracy=ACTIVATIONS)
    if lm_head and cfg.actor_rollout_ref.model.mtp.enable_train and (stage == "last" or layout.pp == 1):
        table.add(f"{role} MTP layers' activations", memory.mtp_activation_bytes(model, layout, tokens),
                  (update_phase,), accuracy=ACTIVATIONS)
    if lora_enabled(lora):
        # the LoRA path of the layer with the most adapters (a simple model: docs/launching.md, LoRA)
        per_token_layer = max(lora_memory.lora_activation_bytes_per_token_layer(
            model, layout, lora.rank, float(lora.dropout), lora_targets(lora, i, model.mla),
            memory.FP32 if dtype in ("fp32", "float32") else memory.BF16, bool(tcfg.sequence_parallel), layer=i)
            for i in memory.stage_layers(model, layout, stage))
        table.add(f"{role} LoRA activations", lora_memory.lora_activation_bytes(
            model, layout, tokens, role_sizes.grad_accumulation_steps, stage, per_token_layer, recompute_of(tcfg)),
            (update_phase,), accuracy=ACTIVATIONS)
    if layout.cp > 1:
        # CP attention (issue 35): Transformer Engine's with the TransformerConfig's cp_comm_type on CUDA
        comm = tcfg.cp_comm_type
        cp_kernel = memory.cp_attention_kernel(layout.cp, comm)
        stored, transient = memory.cp_attention_bytes(cp_kernel, model, layout, tokens,
                                                      role_sizes.grad_accumulation_steps, stage, recompute_of(tcfg))
        table.add(f"{role} CP attention ({cp_kernel})", stored + transient, (update_phase,), accuracy=ACTIVATIONS)
        table.notes.append(_cp_note(role, layout, sequence_length(cfg), tokens, cp_kernel, comm))
        return
    # the attention kernel that runs (models/attention.py), if it keeps more than flash does (issue 32)
    kv_heads, head_dim = memory.core_attention_heads(model)  # MLA: k and v per query head, q/k of nope + rope
    kernel = memory.attention_kernel(
        packed=bool(mcfg.packed_sequences), shared_prompts=bool(mcfg.share_prompts), dtype=dtype,
        dropout=float(tcfg.attention_dropout), q_heads=model.num_attention_heads,
        kv_heads=kv_heads, head_dim=head_dim, tp=layout.tp, window=bool(model.sliding_window))
    kernel_bytes = memory.attention_kernel_bytes(kernel, model, layout, tokens, sequence_length(cfg),
                                                 role_sizes.grad_accumulation_steps, stage, recompute_of(tcfg))
    if kernel_bytes:
        table.add(f"{role} attention kernel ({kernel})", kernel_bytes, (update_phase,), accuracy=ACTIVATIONS)


def build_table(cfg: PPOTrainerConfig, sizes: DerivedSizes, model: HFModelConfig, critic_model: HFModelConfig,
                stage: Stage, teacher: HFModelConfig | None = None) -> PhaseTable:
    """Every row but the rollout engine's, which is sized on what these leave free (add_engine). ``teacher``: the
    distillation teacher's facts, when it runs."""
    phases = ("generate",) + _sync_phase(cfg) + ("actor update",) + (("critic update",) if sizes.uses_critic else ())
    table = PhaseTable(phases)
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
        # offloaded for generation, back only for its own log-probs (not for the actor's weight export)
        ref_phases = tuple(p for p in phases if p not in ("generate", "weight sync")) if ref_mcfg.param_offload else phases
        dtype = _frozen_weights(table, cfg, "ref", model, sizes, ref_phases)
        transformer_config(cfg, REF, model, role_layout(cfg, REF, sizes.world_size), dtype)  # checked before launch
    if teacher is not None:  # on-policy distillation: the teacher's frozen weights at the reference's layout, or
        # served by an HF engine: a whole copy on each rollout leader (the busiest GPU)
        served = served_teacher(cfg.distillation) is not None
        whole = Layout(tp=1, pp=1, cp=1, dp=sizes.world_size) if served else None
        _frozen_weights(table, cfg, "teacher (HF engine)" if served else "teacher", teacher, sizes, phases, whole)
    table.add("reserved (CUDA context, NCCL, fragmentation)", cfg.plan.reserved_gib * GIB, phases)
    return table


def _frozen_weights(table: PhaseTable, cfg: PPOTrainerConfig, label: str, model: HFModelConfig, sizes: DerivedSizes,
                    phases: tuple[str, ...], layout: Layout | None = None) -> str:
    """The row of a frozen model's weights (the reference, the teacher) at ``layout`` (default: the reference's);
    its dtype."""
    layout = layout or role_layout(cfg, REF, sizes.world_size)
    frozen = dataclasses.replace(model, mtp=None)  # a frozen model builds no MTP layers
    params = max(memory.stage_params(frozen, layout, s) for s in ("first", "last"))
    dtype = params_dtype(cfg, cfg.actor_rollout_ref.ref.megatron)
    table.add(f"{label} weights ({dtype})", params * memory.state_bytes_per_param(dtype, False, 1).params, phases)
    return dtype


def add_engine(table: PhaseTable, cfg: PPOTrainerConfig, rollout: RolloutShare) -> None:
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


def _sync_phase(cfg: PPOTrainerConfig) -> tuple[str, ...]:
    """With the actor's param_offload, its weights come back to the GPU for the export while the engine's
    weights are resumed: a phase of its own ("weight sync"), which generation's numbers would hide."""
    colocated = cfg.actor_rollout_ref.rollout.mode == "colocated"
    return ("weight sync",) if colocated and cfg.actor_rollout_ref.actor.megatron.param_offload else ()
