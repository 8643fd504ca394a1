"""Rank jobs of test_lora_moe.py: a LoRA actor on an MoE model (adapters on the attention and on every expert's fc1 /
fc2, B drawn non-zero so the adapters change every output) at CP x EP and TP x ETP layouts, with what the tests
compare gathered to full tensors and named by global expert index."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from cp_jobs import _megatron, cp_batch
from lora_jobs import lora_config
from workers_jobs import ROLLOUT_N, actor_config, update, weights

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel


def _name(adapter, param_name: str) -> str:
    expert = "" if adapter.expert is None else f"expert{adapter.expert}."
    return f"{adapter.layer}.{expert}{adapter.target}.{param_name}"


def _full(adapter, tensor: torch.Tensor, param) -> torch.Tensor:
    """A factor (or its gradient) gathered over the group it is split over (TP, or ETP for an expert's)."""
    if not getattr(param, "tensor_model_parallel", False) or adapter.split_size() == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(adapter.split_size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=adapter.split_group())
    return torch.cat(parts, dim=param.partition_dim)


def adapter_tensors(engine, grads: bool) -> dict[str, torch.Tensor]:
    from megatron_rl.models.lora import adapters_of

    return {_name(adapter, name): _full(adapter, param.main_grad if grads else param, param)
            for adapter in adapters_of(engine.model) for name, param in adapter.named_parameters()}


def _actor(model_dir: str, layout: dict[str, Any], tp: int, adapter_path: str | None = None):
    from megatron_rl.workers import ActorRole, MegatronEngine

    config = _megatron(actor_config(tp=tp), layout)
    lora = lora_config(adapter_path=adapter_path)
    return ActorRole(MegatronEngine(model_dir, config.megatron, config.optim, lora=lora), config, rollout_n=ROLLOUT_N)


RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def lora_moe_job(model_dir: str, cp: int = 1, ep: int = 1, tp: int = 1, etp: int | None = None,
                 save_dir: str | None = None, ckpt_dir: str | None = None, recompute: bool = False) -> dict[str, Any]:
    """Log-probs (adapters on and off), one update's metrics, every adapter's gradient and value after it, the
    merged weights the engines get, the log-probs after; ``save_dir``: the PEFT adapter written after the update;
    ``ckpt_dir``: the training checkpoint saved after it, then a second update's adapters (Adam's step 2);
    ``recompute``: Megatron's full recompute of every layer."""
    from megatron_rl.models.lora import adapters_disabled
    from megatron_rl.models.peft_adapter import save_peft_adapter
    from megatron_rl.workers.forward import compute_log_probs
    from workers_jobs import TEMPERATURE

    init_model_parallel(tp=tp, cp=cp, ep=ep, etp=etp)
    layout = {"context_parallel_size": cp, "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp,
              "sequence_parallel": tp > 1,
              "override_transformer_config": {"moe_aux_loss_coeff": 0.01, **(RECOMPUTE if recompute else {})}}
    data = cp_batch()
    actor = _actor(model_dir, layout, tp)
    engine = actor.engine
    out: dict[str, Any] = {
        "trainable": sorted({n.split(".", 1)[1] if n.startswith("module.") else n
                             for c in engine.model for n, p in c.named_parameters() if p.requires_grad}),
        "log_probs": actor.compute_log_prob(data).batch["old_log_probs"],
        "expert_dp_params": sorted(n for c in engine.model for n, p in c.named_parameters()
                                   if p.requires_grad and not getattr(p, "allreduce", True)),
    }
    with adapters_disabled(engine.model):
        out["log_probs_adapters_off"] = compute_log_probs(engine, data, actor.log_prob_spec, TEMPERATURE, False,
                                                          "test")["log_probs"]
    out["adapters_before"] = adapter_tensors(engine, grads=False)
    out["metrics"] = update(actor, data)
    out["grads"] = adapter_tensors(engine, grads=True)
    out["adapters_after"] = adapter_tensors(engine, grads=False)
    out["exported"] = weights(actor)
    out["log_probs_after"] = actor.compute_log_prob(data).batch["old_log_probs"]
    if save_dir is not None:
        save_peft_adapter(engine.model, save_dir, model_dir)
    if ckpt_dir is not None:
        actor.save_checkpoint(ckpt_dir)
        update(actor, data)
        out["adapters_next"] = adapter_tensors(engine, grads=False)
    destroy_model_parallel()
    return out


def resume_job(model_dir: str, ckpt_dir: str) -> dict[str, Any]:
    """One rank resumes a LoRA checkpoint saved at another layout: its adapters, and after a second update (Adam's
    step 2, from the loaded moments) the adapters again."""
    init_model_parallel()
    actor = _actor(model_dir, {}, 1)
    actor.load_checkpoint(ckpt_dir)
    out = {"adapters": adapter_tensors(actor.engine, grads=False)}
    update(actor, cp_batch())
    out["adapters_next"] = adapter_tensors(actor.engine, grads=False)
    destroy_model_parallel()
    return out


def peft_load_job(model_dir: str, adapter_dir: str, ep: int = 1) -> dict[str, Any]:
    """The actor started from a PEFT adapter directory (lora.adapter_path) at EP=``ep``: its log-probs."""
    init_model_parallel(ep=ep)
    actor = _actor(model_dir, {"expert_model_parallel_size": ep}, 1, adapter_path=adapter_dir)
    out = {"log_probs": actor.compute_log_prob(cp_batch()).batch["old_log_probs"]}
    destroy_model_parallel()
    return out
