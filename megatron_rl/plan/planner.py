"""Dry-run plan: the batch arithmetic of ``validate()`` plus memory per GPU, checked against the GPU.

``build_plan(cfg)`` raises ``PlanError`` (a ConfigError) when the layout does not factor for this model
or a phase of a step needs more memory than the GPU has; ``print_plan(cfg)`` is what ``--dry-run`` runs.
The entries (``build_plan``, ``print_plan``, ``check_launch``) take the composed DictConfig or the typed tree
and convert a DictConfig once (config/loader.py ``checked_typed_config``); everything below them reads the typed
tree, and a what-if plan (without LoRA, without the distributed optimizer, unsplit) is a copy of it with values
replaced (config/access.py ``replace_path``).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Optional

from omegaconf import DictConfig

from megatron_rl.config import ConfigError
from megatron_rl.config.access import is_unset, megatron_section, replace_path
from megatron_rl.config.loader import checked_typed_config
from megatron_rl.config.lora import check_lora_model, lora_enabled
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.distributed.device import rollout_on_cpu
from megatron_rl.models import capabilities
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.moe_experts import choose_expert_layer
from megatron_rl.plan import memory
from megatron_rl.plan.budget import add_engine, build_table, sequence_length
from megatron_rl.plan.context_parallel import context_parallel_roles
from megatron_rl.plan.layout import (
    ACTOR,
    REF,
    ROLE_PREFIX,
    ROLLOUT,
    check_factors,
    check_rollout_factors,
    importable as _importable,  # the module name tests stand in for a machine without TE or DeepEP
    params_dtype,
    role_layout,
    role_model,
    te_kernel_flags,
)
from megatron_rl.plan.lora import (
    full_tuning_note,
    lora_dtype,
    lora_trainable_params,  # noqa: F401  (imported from here by the LoRA plan's tests)
    lora_trainable_stage_params,
    trainable_notes,
    without_lora,
)
from megatron_rl.plan.memory import Layout, Stage
from megatron_rl.plan.model_facts import TEACHER, load_model_facts
from megatron_rl.plan.report import GIB, Plan, PlanError, RolloutShare, in_gib
from megatron_rl.plan.traffic import plan_sync_traffic
from megatron_rl.plan.validate import validate
from megatron_rl.plan.vision import vision_run_problem
from megatron_rl.rollout.engines import engine_of
from megatron_rl.rollout.memory import EngineStart
from megatron_rl.rollout.mesh import build_rollout_mesh, default_places
from megatron_rl.workers.checkpoint import LEGACY_OPTIMIZER_SHARDING_TYPE, OPTIMIZER_SHARDING_TYPE


def _rollout_share(cfg: PPOTrainerConfig, model: HFModelConfig, world: int, gpu_memory: float,
                   held: float) -> RolloutShare:
    """The engine's share of one GPU, by its own meaning of rollout.gpu_memory_utilization (rollout/memory.py):
    SGLang's fraction of the memory free when it starts, vLLM's fraction of the total. ``held``: what is in use
    when it starts; colocated, the actor (weights, grads, fp32 master weights) and the reference, which
    workers/hybrid.py builds first, and plan.reserved_gib."""
    rcfg = cfg.actor_rollout_ref.rollout
    tp = rcfg.tensor_model_parallel_size
    check_rollout_factors(model, tp)
    drafts = bool(cfg.actor_rollout_ref.model.mtp.enable_rollout)  # the engine holds the MTP layers it drafts with
    start = EngineStart(total=gpu_memory, held=held, weights=memory.rollout_weight_bytes(model, tp, drafts),
                        fraction=float(rcfg.gpu_memory_utilization), model=model, tp=tp,
                        max_num_seqs=int(rcfg.max_num_seqs), max_num_batched_tokens=int(rcfg.max_num_batched_tokens),
                        enforce_eager=bool(rcfg.enforce_eager))
    mem = engine_of(rcfg).memory(start)
    if mem.refusal is not None:
        raise PlanError(mem.refusal)
    kv_tokens = int(max(mem.kv_cache, 0.0) // memory.kv_cache_bytes_per_token(model, tp))
    # Colocated: the same function the workers build their engines with (rollout/mesh.py), on the launchers' rank
    # layout; server mode: the servers the run starts, or those it is given
    engines = (build_rollout_mesh(default_places(world, cfg.trainer.n_gpus_per_node), tp).num_engines
               if rcfg.mode == "colocated" else rcfg.num_servers or len(rcfg.server_urls))
    seq = sequence_length(cfg)
    if kv_tokens < seq:
        raise PlanError(
            f"{ROLLOUT}.gpu_memory_utilization={rcfg.gpu_memory_utilization} reserves that fraction of the "
            f"{in_gib(mem.base)} GiB per GPU {mem.base_label} ({mem.engine}: {mem.meaning}) = {in_gib(mem.budget)} "
            f"GiB, but at {ROLLOUT}.tensor_model_parallel_size={tp} the engine's weights take {in_gib(start.weights)} "
            f"GiB, leaving KV cache for {kv_tokens} tokens: less than one sequence of {seq} (prompt + response); "
            f"raise gpu_memory_utilization or the rollout TP")
    return RolloutShare(engines=engines, tp=tp, memory=mem, kv_tokens=kv_tokens)


def _check_model_factors(cfg: PPOTrainerConfig, model: HFModelConfig, uses_critic: bool,
                         world: int) -> HFModelConfig:
    """Every role's layout against its model (refused naming the key); returns the critic's model."""
    check_factors(model, ACTOR, role_layout(cfg, ACTOR, world), cfg)
    check_lora_model(model, "actor_rollout_ref.model", cfg.actor_rollout_ref.model.lora,
                     cfg.actor_rollout_ref.actor.megatron, "actor_rollout_ref.actor.megatron")
    if REF in context_parallel_roles(cfg, uses_critic):
        check_factors(model, REF, role_layout(cfg, REF, world), cfg)
    elif lora_enabled(cfg.actor_rollout_ref.model.lora):
        pass  # the reference is the actor with its adapters off: no layout of its own
    else:
        check_factors(model, REF, role_layout(cfg, REF, world), None)
    critic_model = model
    if uses_critic:
        if not is_unset(cfg.critic.model, "path"):  # else the critic starts from the actor's model
            critic_model = load_model_facts(cfg, "critic.model")
        check_factors(critic_model, "critic", role_layout(cfg, "critic", world), cfg)
        check_lora_model(critic_model, "critic.model", cfg.critic.model.lora, cfg.critic.megatron,
                         "critic.megatron")
    return critic_model


def check_vision(cfg: PPOTrainerConfig, model: HFModelConfig, uses_critic: bool) -> None:
    """A vision-language model (plan/vision.py): what is not built for it refused before launch, naming the key:
    context parallelism, packed (THD) micro-batches (the workers'
    rule, workers/engine.py; the verl entry turns verl's use_remove_padding into padded ones itself)."""
    if model.vision is None:
        if cfg.actor_rollout_ref.actor.freeze_vision_tower:  # the engine's refusal (workers/engine.py), here first
            raise PlanError(f"{ACTOR}.freeze_vision_tower=true, but {model.architecture} has no vision tower (a "
                            "vision-language model's, e.g. Qwen2_5_VLForConditionalGeneration); drop the key")
        return
    roles = [ACTOR, REF] + (["critic"] if uses_critic else [])
    problem = vision_run_problem(model, {f"{role}.megatron.context_parallel_size":
                                         int(megatron_section(cfg, role).context_parallel_size) for role in roles})
    if problem is not None:
        raise PlanError(problem)
    for role in roles:
        if megatron_section(cfg, role).packed_sequences:
            raise PlanError(f"{role}.megatron.packed_sequences=true with a vision-language model "
                            f"({model.architecture}): its mRoPE positions and images ride with padded micro-batches "
                            "only; set it false")


def _plan(cfg: PPOTrainerConfig) -> Plan:
    """The plan at the busiest actor stage, fitting or not."""
    sizes = validate(cfg)
    model = load_model_facts(cfg)
    check_vision(cfg, model, sizes.uses_critic)
    world = sizes.world_size
    actor_layout = role_layout(cfg, ACTOR, world)
    critic_model = _check_model_factors(cfg, model, sizes.uses_critic, world)
    teacher = load_model_facts(cfg, TEACHER) if cfg.distillation.enabled else None
    gpu_memory = cfg.plan.gpu_memory_gib * GIB
    candidates = []
    for stage in (("first", "last") if actor_layout.pp > 1 else ("first",)):
        table = build_table(cfg, sizes, model, critic_model, stage, teacher)
        # Server mode: the engine has its GPU to itself.
        held = table.at_engine_start if cfg.actor_rollout_ref.rollout.mode == "colocated" else 0.0
        rollout = _rollout_share(cfg, model, world, gpu_memory, held)
        add_engine(table, cfg, rollout)
        candidates.append(Plan(sizes, model, gpu_memory, actor_layout, stage, table.phases, tuple(table.rows),
                               rollout, sequence_length(cfg), tuple(table.notes)))
    return max(candidates, key=lambda p: p.total(p.peak_phase()))


def _lora_notes(cfg: PPOTrainerConfig, plan: Plan) -> tuple[str, ...]:
    """With LoRA: the trainable parameters, and the saving against full fine-tuning (the same config with rank 0)."""
    notes = trainable_notes(cfg, plan)
    if not notes:
        return ()
    try:
        full = _plan(without_lora(cfg))
    except ConfigError as err:
        return (*notes, f"vs full fine-tuning: it does not run ({str(err).splitlines()[0]})")
    return (*notes, full_tuning_note(plan, full))


# issue 39: below this hidden size a model-parallel split is slower than none. Splitting a layer over TP ranks adds
# all-reduces of the micro-batch's tokens x hidden activations (2 forward, 2 backward per layer) while each rank's
# matmuls shrink to tokens x hidden^2 / TP: the compute per byte sent grows with the hidden size, and below ~1k a
# layer's matmuls take less time than its collectives (measured on CPU: the tiny preset's 64-wide 2-layer model ran
# 3.2x slower a step at TP=2 on two Ray ranks than at TP=1 on one rank with shared prompts, benchmarks/README.md).
# PP and CP add their own sends alike.
SPLIT_MIN_HIDDEN = 1024
_SPLIT_KEYS = (("tensor_model_parallel_size", "tp"), ("pipeline_model_parallel_size", "pp"),
               ("context_parallel_size", "cp"))


def slower_layout_note(cfg: PPOTrainerConfig, plan: Plan) -> Optional[str]:
    """A note when the actor's model-parallel split (TP, PP or CP > 1) is slower than no split would be: the model
    is narrower than SPLIT_MIN_HIDDEN and the same job with TP = PP = CP = 1 fits in plan.gpu_memory_gib. None
    otherwise (a wide model, no split, or one that needs the split to fit)."""
    split = {key: getattr(plan.actor_layout, attr) for key, attr in _SPLIT_KEYS
             if getattr(plan.actor_layout, attr) > 1}
    if not split or plan.model.hidden_size >= SPLIT_MIN_HIDDEN:
        return None
    unsplit = replace_path(cfg, f"{ACTOR}.megatron", dataclasses.replace(
        cfg.actor_rollout_ref.actor.megatron, **dict.fromkeys(split, 1), virtual_pipeline_model_parallel_size=None,
        sequence_parallel=False))
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
            f"(peak {in_gib(other.total(other.peak_phase()))} of {in_gib(plan.gpu_memory)} GiB per GPU): {keys}{fewer} "
            f"(docs/launching.md, 'Layouts slower than a smaller one')")


def build_plan(cfg: DictConfig | PPOTrainerConfig) -> Plan:
    """Resolve sizes and memory per GPU; raise ConfigError/PlanError naming the key when it cannot run."""
    cfg = checked_typed_config(cfg)
    plan = _plan(cfg)
    lora_notes = _lora_notes(cfg, plan)
    if lora_notes:
        plan = dataclasses.replace(plan, notes=plan.notes + lora_notes)
    slower = slower_layout_note(cfg, plan) if plan.fits else None
    if slower is not None:
        plan = dataclasses.replace(plan, notes=plan.notes + (slower,))
    if plan.over_beyond_error:
        raise PlanError(plan.refusal())
    return plan


def _distributed_optimizer_keys(cfg: PPOTrainerConfig) -> list[str]:
    sizes = validate(cfg)
    prefixes = [ACTOR] + (["critic"] if sizes.uses_critic else [])
    return [f"{p}.megatron.use_distributed_optimizer" for p in prefixes
            if megatron_section(cfg, p).use_distributed_optimizer]


def plan_without_distributed_optimizer(cfg: PPOTrainerConfig, keys: list[str]) -> str:
    """The plan with ``keys`` set to false, formatted (or why that one does not run either)."""
    without = cfg
    for key in keys:
        without = replace_path(without, key, False)
    try:
        return build_plan(without).format()
    except ConfigError as err:
        return f"that does not run either: {err}"


def distributed_optimizer_problem(cfg: PPOTrainerConfig) -> Optional[str]:
    """Why this environment cannot give the distributed optimizer the config asks for, with the plan
    without it; None when it is not asked for or is available."""
    keys = _distributed_optimizer_keys(cfg)
    blocker = capabilities.distributed_optimizer_blocker() if keys else None
    if blocker is None:
        return None
    return (f"{' and '.join(f'{k}=true' for k in keys)} {blocker}. Install megatron-rl[gpu] (Transformer Engine) "
            f"or set {' and '.join(f'{k}=false' for k in keys)}; without it the plan is:\n"
            f"{plan_without_distributed_optimizer(cfg, keys)}")


def _check_kernels_here(cfg: PPOTrainerConfig, prefix: str) -> None:
    """A role's fused kernels (Transformer Engine's, DeepEP's dispatcher) where this machine cannot run them."""
    given = dict(megatron_section(cfg, prefix).override_transformer_config or {})
    kernels = te_kernel_flags(given)
    if kernels and not _importable("transformer_engine"):
        raise PlanError(f"{prefix}.megatron.override_transformer_config sets {kernels}: fused kernels of "
                        "Transformer Engine, which does not import here; install megatron-rl[gpu] or set them "
                        "false")
    if given.get("moe_grouped_gemm") is True:  # TE imports, but the run's device may still be the CPU
        try:
            choose_expert_layer(True, cuda=str(cfg.trainer.device) != "cpu", te=_importable("transformer_engine"),
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


def check_launch(cfg: DictConfig | PPOTrainerConfig) -> None:
    """What only the launching environment can tell, checked before any worker starts (train.py): a
    distributed optimizer asked for but not available here is refused with the reason and the plan
    without it (the engine would refuse it too, after minutes of start-up); on GPUs, a rollout engine that
    would refuse to start on the memory free when it starts (rollout/memory.py)."""
    cfg = checked_typed_config(cfg)
    try:
        model = load_model_facts(cfg)
    except ConfigError:
        model = None  # no model to read here: preflight reads it on the nodes
    if model is not None:
        check_vision(cfg, model, validate(cfg).uses_critic)
    problem = distributed_optimizer_problem(cfg)
    if problem is not None:
        raise PlanError(problem)
    if not rollout_on_cpu(cfg):  # the run's device, as the engines will see it
        # the engine's own start-up memory check (vLLM refuses when less than its share of the total is free) on
        # the memory the plan has in use when the engine starts: refused here, not after the workers built the actor;
        # and a plan over the GPU by more than its estimate's error (a warning when by less: it starts)
        plan = _plan(cfg)
        if plan.over_beyond_error:
            raise PlanError(plan.refusal())
        if (warning := plan.edge_warning()) is not None:
            print(warning, file=sys.stderr, flush=True)
    for prefix in (ACTOR, REF, "critic"):
        _check_kernels_here(cfg, prefix)


def _stage_save_host_bytes(model: HFModelConfig, layout: Layout, stage: Stage, lm_head: bool, dtype: str,
                           dist_opt: bool, kind: str) -> float:
    """Host RAM at save for one stage's Adam state: an MoE model's experts are sharded over expert-DP, the rest
    over DP x CP (as the optimizer rows count them)."""
    experts = memory.stage_expert_params(model, layout, stage)
    dense = memory.stage_params(model, layout, stage, lm_head=lm_head) - experts
    return (memory.checkpoint_save_host_bytes(dense, dtype, dist_opt, layout.dp * layout.cp, kind)
            + memory.checkpoint_save_host_bytes(experts, dtype, dist_opt, memory.expert_data_parallel(layout), kind))


def checkpoint_host_ram(cfg: PPOTrainerConfig) -> str:
    """Host RAM per rank for the Adam state while a trained role's checkpoint is saved (issue 32): now
    (``fully_sharded_model_space``) and what the ``fully_reshardable`` gather of older saves took."""
    sizes = validate(cfg)
    model = load_model_facts(cfg)
    lines = []
    for role in ("actor",) + (("critic",) if sizes.uses_critic else ()):
        prefix = ROLE_PREFIX[role]
        mcfg = megatron_section(cfg, prefix)
        critic_model = model
        if role == "critic" and not is_unset(cfg.critic.model, "path"):
            critic_model = load_model_facts(cfg, "critic.model")
        trained_model = model if role == "actor" else critic_model
        layout = role_layout(cfg, prefix, sizes.world_size)
        dtype = params_dtype(cfg, mcfg)
        dist_opt = bool(mcfg.use_distributed_optimizer)
        lora = role_model(cfg, role).lora
        if lora_enabled(lora):  # the Adam state of the adapters (and the critic's value head) only
            params = max(lora_trainable_stage_params(trained_model, layout, s, lora, role == "actor")
                         for s in ("first", "last"))
            dtype = lora_dtype(lora, dtype)
            now, old = (memory.checkpoint_save_host_bytes(params, dtype, dist_opt, layout.dp * layout.cp, kind)
                        for kind in (OPTIMIZER_SHARDING_TYPE, LEGACY_OPTIMIZER_SHARDING_TYPE))
        else:
            now, old = (max(_stage_save_host_bytes(trained_model, layout, s, role == "actor", dtype, dist_opt, kind)
                            for s in ("first", "last"))
                        for kind in (OPTIMIZER_SHARDING_TYPE, LEGACY_OPTIMIZER_SHARDING_TYPE))
        lines.append(f"checkpoint save, host RAM per rank for the {role}'s Adam state: {in_gib(now)} GiB "
                     f"({OPTIMIZER_SHARDING_TYPE if dist_opt else 'no distributed optimizer'}; the "
                     f"{LEGACY_OPTIMIZER_SHARDING_TYPE} gather of older saves: {in_gib(old)} GiB)")
    return "\n".join(lines)


def print_plan(cfg: DictConfig | PPOTrainerConfig, title: Optional[str] = None) -> Plan:
    """Print the plan (what ``--dry-run`` shows) and return it; raises PlanError when it cannot run.

    The plan is of the target cluster; what this environment lacks for it (TE/Apex for the distributed
    optimizer) is printed as a note, and a real start from here is refused (``check_launch``)."""
    cfg = checked_typed_config(cfg)
    plan = build_plan(cfg)
    if title:
        print(title)
    print(plan.format())
    if (warning := plan.edge_warning()) is not None:
        print(warning)
    print(plan_sync_traffic(cfg, plan))  # issue 16: the weight-sync traffic model
    print(checkpoint_host_ram(cfg))
    problem = distributed_optimizer_problem(cfg)
    if problem is not None:
        print(f"note: a start from this environment is refused: {problem}")
    return plan
