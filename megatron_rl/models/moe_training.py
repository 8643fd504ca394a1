"""MoE router losses in training: what the coefficients mean here, and their logged values.

Megatron-Core 0.16.1 adds the load-balancing loss (``moe_aux_loss_coeff``) and the router z-loss
(``moe_z_loss_coeff``) through ``MoEAuxLossAutoScaler`` in every micro-batch's backward. Megatron's own
training averages those gradients over micro-batches and data-parallel ranks (it scales by
1/num_microbatches and averages over DP). The engine does neither (its policy loss is already normalised to
the global mini-batch and DP gradients are summed, workers/engine.py), and its routers are built before the
engine turns on ``calculate_per_token_loss`` (so they take Megatron's unscaled path). Left alone, the router
losses would weigh ``num_microbatches x DP`` times their coefficient. ``router_loss_scaling`` divides the
coefficients by that for the backward pass of one mini-batch, so a coefficient means what it means in
Megatron (and in verl/slime, which train with Megatron's schedule): ``coeff x`` the mean router loss.

``ExpertLoad`` counts the tokens each router sends to each expert in the training forwards and reports, per
layer, the busiest expert's load relative to a uniform split (``moe_expert_load/layer_<i>``: 1 = balanced,
E / top-k = every token on the same top-k experts), over all micro-batches and ranks of one update.

``freeze_routers`` (``megatron.freeze_router``) keeps every MoE router's weights out of training: one of the
anchors' answers to the mismatch between the rollout engine's routing and the trainer's (docs/models.md).

Megatron logs the loss values divided by their coefficient, so ``moe_metrics`` reports the raw losses (the actor logs them as ``actor/moe_aux_loss`` ...), summed
over the pipeline stages' layers as Megatron does, averaged over layers and DP ranks; per-layer values too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # megatron-core: this module imports it only inside the functions that run it
    from megatron.core.transformer import TransformerConfig

# Megatron's tracker name -> our metric name
_TRACKED = {"load_balancing_loss": "moe_aux_loss", "z_loss": "moe_z_loss"}


@contextlib.contextmanager
def router_loss_scaling(config: TransformerConfig, num_microbatches: int, dp_size: int) -> Iterator[None]:
    """Router-loss coefficients of ``config`` divided by ``num_microbatches x dp_size`` inside the block."""
    if getattr(config, "num_moe_experts", None) is None:
        yield
        return
    saved = (config.moe_aux_loss_coeff, config.moe_z_loss_coeff)
    factor = num_microbatches * dp_size

    def scaled(coeff):
        if coeff is None:
            return None
        if isinstance(coeff, (list, tuple)):
            return [c / factor for c in coeff]
        return coeff / factor

    config.moe_aux_loss_coeff, config.moe_z_loss_coeff = scaled(saved[0]), scaled(saved[1])
    try:
        yield
    finally:
        config.moe_aux_loss_coeff, config.moe_z_loss_coeff = saved


def moe_padding(model: torch.nn.Module, padding: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The ``padding_mask`` keyword of a model chunk's forward: True at a micro-batch's pad positions ([b, s] as
    the input ids), which Megatron's MoE routers leave out of the load-balancing and z losses. Pad tokens appear
    where a pack is rounded up (2 x CP per sequence under context parallelism, TP under sequence parallelism) or
    in the padded layout; counting them made the router losses differ from an unpadded run. Megatron's GPTModel
    splits the mask over TP (sequence parallelism) on the first pipeline stage only, so a later stage's chunk gets
    its TP rank's slice here, as its hidden states are. ``{}`` without padding (a dense model: None)."""
    if padding is None:
        return {}
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model

    if get_attr_wrapped_model(model, "pre_process") or not get_attr_wrapped_model(model, "config").sequence_parallel:
        return {"padding_mask": padding}
    width = padding.shape[1] // parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * width
    return {"padding_mask": padding[:, start : start + width]}


def moe_metrics(num_layers: int, num_microbatches: int) -> dict[str, float]:
    """``moe_aux_loss`` (and ``moe_z_loss`` when on), layer means, plus ``moe_aux_loss/layer_<i>``,
    per micro-batch, from Megatron's tracker since the last call (which it then clears; it sums over the
    ``num_microbatches`` of one optimizer step). Identical on every rank: collective over PP and DP; {} when no
    router loss was computed (dense model, coefficients 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
        reduce_aux_losses_tracker_across_ranks,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    names = [name for name in _TRACKED if name in tracker]
    if not names:
        return {}
    reduce_aux_losses_tracker_across_ranks(names)
    per_name: dict[str, torch.Tensor] = {}
    for name in names:
        values: torch.Tensor = tracker[name]["values"][:num_layers].float()
        if tracker[name].get("reduce_group") is None:  # z-loss: Megatron leaves it per rank
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group(), op=dist.ReduceOp.AVG)
        per_name[name] = values.cpu() / num_microbatches
    # The tracker has a slot per layer; dense layers between MoE layers (moe_layer_freq) never write theirs.
    # Like Megatron's track_moe_metrics, average over the MoE layers only (the slots some loss was added to).
    moe = torch.stack(list(per_name.values())).ne(0).any(dim=0)
    layers = [i for i in range(len(moe)) if moe[i]] or list(range(len(moe)))
    out: dict[str, float] = {}
    for name, values in per_name.items():
        out[_TRACKED[name]] = float(values[layers].mean())
        if name == "load_balancing_loss":
            out.update({f"moe_aux_loss/layer_{i}": float(values[i]) for i in layers})
    clear_aux_losses_tracker()
    return out


def freeze_routers(chunks: list[torch.nn.Module], key: str) -> int:
    """Take every MoE router's parameters out of training (before DDP and the optimizer are built, which then
    leave them out); the number of routers. ``key`` names the config option in the error for a dense model."""
    routers = _routers(chunks)
    if not routers:
        raise ValueError(f"{key}=true needs an MoE model (this one has no router)")
    for router in routers:
        router.requires_grad_(False)
    return len(routers)


def _routers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.transformer.moe.router import Router

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, Router)]


class ExpertLoad:
    """Tokens routed to each expert of each layer in the training forwards since the last ``metrics()``
    (a forward hook on every router of ``chunks``; forwards without grad, i.e. log-prob passes, not counted).
    ``valid`` ([seq, batch] bool, Megatron's token order), set by the engine before each micro-batch's forward,
    leaves pad tokens out; None counts every token (packed micro-batches, or full recompute, whose router runs
    again in the backward pass, possibly after the next micro-batch's forward under PP)."""

    def __init__(self, chunks: list[torch.nn.Module], num_layers: int, num_experts: int) -> None:
        routers = _routers(chunks)
        self.counts = torch.zeros(num_layers, num_experts, device=routers[0].weight.device)
        # The MoE layers of the whole model (every stage): dense layers between them have no router to count.
        pattern = routers[0].config.moe_layer_freq
        self.moe_layers = [
            i for i in range(num_layers) if (pattern[i] if isinstance(pattern, list) else i % pattern == 0)
        ]
        self.valid: torch.Tensor | None = None
        for router in routers:
            router.register_forward_hook(self._count(router.layer_number - 1))  # Megatron's global 1-based

    def _count(self, layer: int):
        def hook(module, inputs, output) -> None:
            if not torch.is_grad_enabled():
                return
            routing_map = output[1]  # [tokens, experts] bool, tokens in [seq, batch] order
            valid = self._valid_rows(routing_map.shape[0])
            self.counts[layer] += (routing_map if valid is None else routing_map[valid]).sum(dim=0)
        return hook

    def _valid_rows(self, tokens: int) -> torch.Tensor | None:
        """The mask of this rank's router tokens: ``valid``, or (sequence parallel) its TP rank's slice of the
        sequence; None (count all) without a mask or when the tokens are laid out otherwise (context parallel)."""
        from megatron.core import parallel_state

        if self.valid is None:
            return None
        valid = self.valid.to(self.counts.device)
        if valid.numel() != tokens:
            rows = valid.shape[0] // parallel_state.get_tensor_model_parallel_world_size()
            start = parallel_state.get_tensor_model_parallel_rank() * rows
            valid = valid[start : start + rows]
        return valid.reshape(-1) if valid.numel() == tokens else None

    def metrics(self) -> dict[str, float]:
        """``moe_expert_load/layer_<i>`` (max / mean tokens per expert) and their mean over layers; a collective
        over all ranks. Summing every rank's counts is exact up to a factor per layer (TP ranks without sequence
        parallelism route the same tokens), which the ratio does not see."""
        import torch.distributed as dist

        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        dist.all_reduce(counts)
        counts = counts[self.moe_layers]
        load = (counts.max(dim=1).values / counts.mean(dim=1).clamp(min=1e-9)).cpu()
        out = {f"moe_expert_load/layer_{i}": float(v) for i, v in zip(self.moe_layers, load, strict=True)}
        out["moe_expert_load"] = float(load.mean())
        return out
