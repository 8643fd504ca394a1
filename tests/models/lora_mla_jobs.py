"""Rank jobs of test_lora_mla.py (importable by spawned ranks): LoRA on the tiny DeepSeek-V3 checkpoints (multi-latent
attention; B drawn non-zero so every adapter moves the output and gets a gradient) at one TP layout: the adapters'
full factors (PEFT-keyed), the logits, the merged export, the adapters' gradients of one training backward through
Megatron's DDP and finalize_model_grads, and a PEFT adapter saved at this layout (``peft_root``) or loaded into
adapters drawn from another seed (``load_root``); with ``attention_root`` the logits and PEFT adapter of a model
adapted on its attention only (transformers 5 fuses the experts, on which PEFT puts no per-expert adapter)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_rl_testing.tiny_models import padded_batch as batch

RANK, ALPHA = 4, 8.0
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # verl's default: all of MLA's attention


def lora_spec(seed: int = 0, targets: tuple[str, ...] = TARGETS):
    from megatron_rl.models.lora import LoRASpec

    return LoRASpec(rank=RANK, alpha=ALPHA, target_modules=targets, a_init="xavier", b_init="xavier",
                    dtype=torch.float32, seed=seed)


def _full_factors(chunks, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every adapter factor (or its DDP main_grad) of this rank gathered to its full size, by PEFT's key."""
    from megatron_rl.models.lora import adapters_of
    from megatron_rl.models.peft_adapter import _factors, _gather_split, peft_key

    out = {}
    for adapter in adapters_of(chunks):
        for hf_module, factor, param, dim in _factors(adapter):
            out[peft_key(adapter.layer, hf_module, factor)] = _gather_split(
                adapter, param.main_grad if grads else param, dim)
    return out


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    """One training forward + backward of deepseek_v3_jobs.gradient_loss through DDP (the base frozen, as the
    engine freezes it), finalize_model_grads; the adapters' full gradients."""
    from deepseek_v3_jobs import gradient_loss
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, \
        finalize_model_grads

    from megatron_rl.models import causal_padding_mask, position_ids_from_mask
    from megatron_rl.models.lora import adapters_of

    input_ids, attention_mask = batch()
    trainable = {id(p) for adapter in adapters_of([model]) for p in adapter.parameters()}
    for param in model.parameters():
        param.requires_grad_(id(param) in trainable)
    model.config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    ddp.train()
    ddp.zero_grad_buffer()
    logits = ddp(input_ids, position_ids_from_mask(attention_mask), causal_padding_mask(attention_mask),
                 runtime_gather_output=True)
    gradient_loss(logits, model.hf_config.vocab_size).backward()
    finalize_model_grads([ddp], None)
    return _full_factors([model], grads=True)


def lora_mla_job(dirs: dict[str, str], tp: int, sp: bool, peft_root: str | None = None,
                 load_root: str | None = None, attention_root: str | None = None) -> dict[str, Any]:
    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.models.lora import adapters_of
    from megatron_rl.models.peft_adapter import load_peft_adapter, save_peft_adapter
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask = batch()
    init_model_parallel(tp=tp)
    out: dict[str, Any] = {}
    for name, directory in dirs.items():
        chunks = build_from_hf(directory, lora=lora_spec(), sequence_parallel=sp)
        adapters = adapters_of(chunks)
        held: dict[str, Any] = {
            "targets": sorted({(a.layer, a.target) for a in adapters}),
            "local_adapter_params": sum(p.numel() for a in adapters for p in a.parameters()),
            "factors": _full_factors(chunks),
            "logits": compute_full_logits(chunks, input_ids, attention_mask),
            "export": {n: t.clone() for n, t in export_hf_weights(chunks)},
        }
        if tp == 1 or sp:  # Megatron's MoE layers refuse to train at TP > 1 without sequence parallelism
            held["grads"] = _adapter_grads(chunks[0])
        if peft_root is not None:
            save_peft_adapter(chunks, Path(peft_root) / name, directory)
        if load_root is not None:  # adapters drawn from another seed, then the saved ones loaded over them
            other = build_from_hf(directory, lora=lora_spec(seed=1), sequence_parallel=sp)
            held["before_load"] = _full_factors(other)
            load_peft_adapter(other, Path(load_root) / name)
            held["loaded"] = _full_factors(other)
            held["loaded_logits"] = compute_full_logits(other, input_ids, attention_mask)
        if attention_root is not None:  # the attention's adapters only: a PEFT adapter PEFT itself can load
            attention = build_from_hf(directory, lora=lora_spec(targets=("linear_qkv", "linear_proj")),
                                      sequence_parallel=sp)
            held["attention_logits"] = compute_full_logits(attention, input_ids, attention_mask)
            save_peft_adapter(attention, Path(attention_root) / name, directory)
        out[name] = held
    destroy_model_parallel()
    return out
