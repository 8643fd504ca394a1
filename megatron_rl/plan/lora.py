"""LoRA in the plan (issue 36): the trainable parameters of the adapters, their dtype, and the notes that compare
a LoRA run with the same run fully fine-tuned."""
from __future__ import annotations

from megatron_rl.config.access import is_unset, replace_path
from megatron_rl.config.lora import lora_enabled, lora_targets
from megatron_rl.config.schema import LoRAConfig, PPOTrainerConfig
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.plan import lora_memory, memory
from megatron_rl.plan.memory import Layout, Stage
from megatron_rl.plan.model_facts import load_model_facts
from megatron_rl.plan.report import Plan, in_gib, short_count


def lora_dtype(lora: LoRAConfig, params_dtype: str) -> str:
    """The adapters' dtype: lora.dtype, else the role's params dtype."""
    return {"float32": "fp32", "bfloat16": "bf16"}.get(str(lora.dtype), str(lora.dtype)) if lora.dtype else params_dtype


# the order the notes name the adapted linears in
_LINEAR_ORDER = ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                 "linear_kv_up_proj", "linear_proj", "linear_fc1", "linear_fc2")


def _targets_of(model: HFModelConfig, lora: LoRAConfig):
    """Global layer i -> its adapted linears (a multi-latent attention model's own attention linears)."""
    mla = getattr(model, "mla", None)
    return lambda i: lora_targets(lora, i, mla)


def lora_trainable_stage_params(model: HFModelConfig, layout: Layout, stage: Stage, lora: LoRAConfig,
                                lm_head: bool) -> float:
    """Trainable parameters on one GPU of the stage: the adapters, and the critic's value head (hidden -> 1,
    trained in full, on the last stage)."""
    adapters = lora_memory.lora_stage_params(model, layout, stage, lora.rank, _targets_of(model, lora))
    value_head = model.hidden_size if not lm_head and (stage == "last" or layout.pp == 1) else 0
    return adapters + value_head


def lora_expert_stage_params(model: HFModelConfig, layout: Layout, stage: Stage, lora: LoRAConfig) -> float:
    """Of ``lora_trainable_stage_params``, the routed experts' adapters: expert-parallel parameters, whose Adam
    state the distributed optimizer shards over the expert-DP group (0 for a dense model)."""
    return lora_memory.lora_stage_expert_params(model, layout, stage, lora.rank, _targets_of(model, lora))


# the whole model on one GPU: no TP, PP or EP split
_WHOLE_MODEL = Layout(tp=1, pp=1, cp=1, dp=1)


def lora_trainable_params(model: HFModelConfig, lora: LoRAConfig) -> int:
    """Adapter parameters of the whole model (no TP split; an MoE model's on every routed expert too)."""
    return int(lora_memory.lora_stage_params(model, _WHOLE_MODEL, "first", lora.rank, _targets_of(model, lora)))


def _expert_targets_note(model: HFModelConfig, lora: LoRAConfig) -> str:
    """The trainable note's aside when adapters sit on an MoE model's experts (a targeted linear_fc1 / linear_fc2
    of an MoE layer): " (and every routed expert's fc1/fc2: E experts x L layers)"; else ""."""
    if model.moe is None:
        return ""
    per_layer = [[t for t in _targets_of(model, lora)(i) if t in lora_memory.MLP_LINEARS]
                 for i in range(model.num_layers) if model.moe.is_moe_layer(i)]
    layers = sum(bool(linears) for linears in per_layer)
    if not layers:
        return ""
    names = "/".join(sorted({t.removeprefix("linear_") for linears in per_layer for t in linears}))
    shared = "the shared expert's and " if model.moe.shared_expert_size else ""
    return (f" (and {shared}every routed expert's {names}: {model.moe.num_experts} experts x {layers} "
            f"layer{'s' if layers != 1 else ''})")


def without_lora(cfg: PPOTrainerConfig) -> PPOTrainerConfig:
    """The same config with LoRA off for the actor and the critic (their blocks as the schema's defaults): full
    fine-tuning."""
    full = cfg
    for key, model in (("actor_rollout_ref.model", cfg.actor_rollout_ref.model), ("critic.model", cfg.critic.model)):
        if model.lora is not None:
            full = replace_path(full, f"{key}.lora", LoRAConfig())
    return full


def trainable_notes(cfg: PPOTrainerConfig, plan: Plan) -> list[str]:
    """A line per role with LoRA: its trainable parameters against the whole model."""
    notes = []
    for role, model_cfg in (("actor", cfg.actor_rollout_ref.model), ("critic", cfg.critic.model)):
        lora = model_cfg.lora
        if not lora_enabled(lora) or (role == "critic" and not plan.sizes.uses_critic):
            continue
        model = plan.model if role == "actor" or is_unset(cfg.critic.model, "path") else \
            load_model_facts(cfg, "critic.model")
        total = memory.total_params(model)
        trainable = lora_trainable_params(model, lora) + (model.hidden_size if role == "critic" else 0)
        targets = sorted({t for i in range(model.num_layers) for t in _targets_of(model, lora)(i)},
                         key=_LINEAR_ORDER.index)
        extra = "; the value head (hidden -> 1) is trained in full" if role == "critic" else ""
        notes.append(f"{role} LoRA rank {lora.rank} (alpha {float(lora.alpha or 16):g}, scale "
                     f"{float(lora.alpha or 16) / lora.rank:g}) on {', '.join(targets)}"
                     f"{_expert_targets_note(model, lora)}: trainable "
                     f"{short_count(trainable)} params ({100 * trainable / total:.2f}% of {short_count(total)}); the "
                     f"base is frozen: no grads, no Adam state{extra}")
    return notes


def _trained_state(plan: Plan, role: str) -> float:
    """Weights + grads + Adam of a trained role in its update (its rows but activations and attention)."""
    phase = f"{role} update"
    return sum(r.per_phase.get(phase, 0.0) for r in plan.rows if r.label.startswith(f"{role} ")
               and "activations" not in r.label and "attention" not in r.label)


def full_tuning_note(plan: Plan, full: Plan) -> str:
    """What the LoRA ``plan`` saves against ``full``, the same run fully fine-tuned."""
    update = "actor update"
    peak, full_peak = plan.peak_phase(), full.peak_phase()
    return (f"vs full fine-tuning, per GPU: actor weights + grads + Adam {in_gib(_trained_state(full, 'actor'))} -> "
            f"{in_gib(_trained_state(plan, 'actor'))} GiB; update {in_gib(full.total(update))} GiB -> "
            f"{in_gib(plan.total(update))} GiB; peak {in_gib(full.total(full_peak))} GiB ({full_peak}) -> "
            f"{in_gib(plan.total(peak))} GiB ({peak}); KV cache per engine {full.rollout.kv_tokens:,} -> "
            f"{plan.rollout.kv_tokens:,} tokens")
