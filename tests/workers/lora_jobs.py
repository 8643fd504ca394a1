"""Rank jobs of test_lora.py: a LoRA actor (non-zero B, so the adapters change every output) at TP/PP/SP
layouts, with what the tests compare gathered to full tensors."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from workers_jobs import ROLLOUT_N, TEMPERATURE, actor_config, training_batch, update

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel

TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def lora_config(rank: int = 4, alpha: float = 8.0, b_init: str = "normal", **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, alpha=alpha, dropout=0.0, target_modules=TARGETS, exclude_modules=[],
                           lora_A_init_method="xavier", lora_B_init_method=b_init, dtype=None, **extra)


def _full(tensor: torch.Tensor, param) -> torch.Tensor:
    """A TP-split adapter factor (or its gradient) gathered to its full size."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def adapter_tensors(engine, grads: bool) -> dict[str, torch.Tensor]:
    """{"<layer>.<target>.<factor>": full tensor} of this rank's pipeline stage (values or main_grads)."""
    from megatron_rl.models.lora import adapters_of

    out = {}
    for adapter in adapters_of(engine.model):
        for name, param in adapter.named_parameters():
            out[f"{adapter.layer}.{adapter.target}.{name}"] = _full(param.main_grad if grads else param, param)
    return out


def _actor(model_dir: str, tp: int, pp: int, sp: bool, lora, cp: int = 1):
    from megatron_rl.workers import ActorRole, MegatronEngine

    config = actor_config(tp=tp, pp=pp)
    config = replace(config, megatron=replace(config.megatron, sequence_parallel=sp, context_parallel_size=cp,
                                              packed_sequences=cp > 1))
    return ActorRole(MegatronEngine(model_dir, config.megatron, config.optim, lora=lora), config, rollout_n=ROLLOUT_N)


def lora_job(model_dir: str, tp: int, pp: int, sp: bool = False, cp: int = 1) -> dict[str, Any]:
    from megatron_rl.models.lora import adapters_disabled
    from megatron_rl.workers.forward import compute_log_probs

    init_model_parallel(tp=tp, pp=pp, cp=cp)
    data = training_batch()
    actor = _actor(model_dir, tp, pp, sp, lora_config(), cp)
    engine = actor.engine
    out: dict[str, Any] = {
        "trainable": sorted(n for c in engine.model for n, p in c.named_parameters() if p.requires_grad),
        "frozen_with_grad_buffer": sorted(n for c in engine.model for n, p in c.named_parameters()
                                          if not p.requires_grad and getattr(p, "main_grad", None) is not None),
        "optimizer_params": sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"]),
        "adapter_params": sum(p.numel() for c in engine.model for n, p in c.named_parameters() if p.requires_grad),
        "log_probs": actor.compute_log_prob(data).batch["old_log_probs"],
    }
    with adapters_disabled(engine.model):
        out["base_log_probs_adapters_off"] = compute_log_probs(engine, data, actor.log_prob_spec, TEMPERATURE, False,
                                                               "test")["log_probs"]
    out["metrics"] = update(actor, data)
    out["grads"] = adapter_tensors(engine, grads=True)
    out["adapters_after"] = adapter_tensors(engine, grads=False)
    out["log_probs_after"] = actor.compute_log_prob(data).batch["old_log_probs"]
    destroy_model_parallel()
    return out


def base_job(model_dir: str) -> torch.Tensor:
    """The base model's log-probs (no LoRA), one rank."""
    from megatron_rl.workers import ActorRole, MegatronEngine

    init_model_parallel()
    config = actor_config()
    actor = ActorRole(MegatronEngine(model_dir, config.megatron, config.optim), config, rollout_n=ROLLOUT_N)
    log_probs = actor.compute_log_prob(training_batch()).batch["old_log_probs"]
    destroy_model_parallel()
    return log_probs


def merged_export_job(model_dir: str, tp: int, pp: int = 1) -> dict[str, Any]:
    """After one LoRA update: the weights the engines get (export_hf_weights, merged) and the full adapters."""
    from megatron_rl.weights import export_hf_weights

    init_model_parallel(tp=tp, pp=pp)
    actor = _actor(model_dir, tp, pp, False, lora_config())
    update(actor, training_batch())
    exported = {name: tensor.clone() for name, tensor in export_hf_weights(actor.engine.model)}
    adapters = {k: v for k, v in adapter_tensors(actor.engine, grads=False).items()}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, adapters)
    destroy_model_parallel()
    return {"exported": exported, "adapters": {k: v for part in gathered for k, v in part.items()}}


def critic_lora_job(critic_dir: str, tp: int) -> dict[str, Any]:
    """A critic with LoRA: its adapters and its value head train; values and the update at TP=``tp``."""
    from workers_jobs import critic_config

    from megatron_rl.workers import CriticRole, MegatronEngine

    init_model_parallel(tp=tp)
    config = critic_config(tp=tp)
    engine = MegatronEngine(critic_dir, config.megatron, config.optim, value_head=True, name="critic",
                            lora=lora_config())
    critic = CriticRole(engine, config, rollout_n=ROLLOUT_N)
    data = training_batch()
    out = {"trainable": sorted(n for c in engine.model for n, p in c.named_parameters() if p.requires_grad),
           "values": critic.compute_values(data).batch["values"],
           "metrics": critic.update_critic(data).meta_info["metrics"]}
    out["values_after"] = critic.compute_values(data).batch["values"]
    destroy_model_parallel()
    return out
