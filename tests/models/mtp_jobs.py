"""Rank jobs of test_mtp.py (importable by spawned ranks): the multi-token-prediction layers built on Megatron at
TP 1 and 2 (sequence parallel at 2, as MoE training needs), their export, their loss and gradients."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl_testing.tiny_models import padded_batch as batch


def mtp_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depth-1 labels (token i + 2 at position i) and the mask of positions whose i, i + 1 and i + 2 are real."""
    labels = torch.zeros_like(input_ids)
    labels[:, :-2] = input_ids[:, 2:]
    real = attention_mask.bool()
    mask = torch.zeros(input_ids.shape, dtype=torch.float32)
    mask[:, :-2] = (real[:, :-2] & real[:, 1:-1] & real[:, 2:]).float()
    return labels, mask


def _full_grads(model, prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``.grad`` of the parameters whose HF names start with ``prefixes``, TP shards gathered, by HF name."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_rl.models.layout import Kind, chunk_mappings, hf_from_shards

    grads: dict[str, torch.Tensor] = {}
    for mapping in chunk_mappings(model):
        if not mapping.group.key.startswith(prefixes) or not mapping.load or mapping.group.expert is not None:
            continue
        grad = mapping.param.grad
        grad = torch.zeros_like(mapping.param) if grad is None else grad.detach().clone()
        if getattr(mapping.param, "sequence_parallel", False):  # partial sums over the sequence slices, as
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())  # finalize_model_grads
        shards = [grad]
        if mapping.group.kind is not Kind.REPLICATED:
            group = parallel_state.get_tensor_model_parallel_group()
            shards = [torch.empty_like(grad) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, grad.contiguous(), group=group)
        for tensor, full in zip(mapping.group.tensors, hf_from_shards(model.hf_config, mapping.group, shards),
                                strict=True):
            grads[tensor.name] = full.contiguous()
    return grads


def mtp_checks(dirs: dict[str, str], tps: list[int]) -> dict[Any, Any]:
    """For each TP and checkpoint: the main logits and the export with the MTP layer built; then, without and with
    detach_encoder, one training forward with depth-1 targets on every real position: the MTP loss (mean over the
    targets), the MTP layer's gradients by HF name, and the largest gradient the main model's decoder got."""
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, causal_padding_mask, compute_full_logits, position_ids_from_mask
    from megatron_rl.models.mtp_model import MTPTargets
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask = batch()
    labels, mask = mtp_targets(input_ids, attention_mask)
    out: dict[Any, Any] = {}
    for tp in tps:
        init_model_parallel(tp=tp)
        for name, directory in dirs.items():
            chunks = build_from_hf(directory, mtp=True, sequence_parallel=tp > 1)
            out[name, tp, "logits"] = compute_full_logits(chunks, input_ids, attention_mask)
            out[name, tp, "export"] = {n: t.clone() for n, t in export_hf_weights(chunks)}
            mtp_prefix = chunks[0].hf_config.mtp.prefix(0)
            for detach in (False, True):
                model = build_from_hf(directory, mtp=True, sequence_parallel=tp > 1)[0]
                model.train()
                model.mtp_targets = MTPTargets([labels], [mask], 1.0, detach)
                logits = model(input_ids, position_ids_from_mask(attention_mask), causal_padding_mask(attention_mask))
                (logits.float().sum() * 0).backward()  # the MTP loss joins through MTPLossAutoScaler
                sums, counts = model.take_mtp_losses()
                main_grad = max(float(p.grad.abs().max()) for p in model.decoder.parameters() if p.grad is not None)
                out[name, tp, detach] = dict(loss=float(sums[0] / counts[0]), tokens=float(counts[0]),
                                             grads=_full_grads(model, (mtp_prefix,)), main_grad=main_grad)
    return out
