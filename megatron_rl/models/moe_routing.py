"""Routing agreement: do the rollout engine and the trainer send each token to the same experts?

In MoE RL the engine samples with its routing and the trainer scores the same tokens with its own; tokens whose
top-k experts differ get log-probs from different sub-networks, the main source of rollout/trainer mismatch on
MoE models (the reason for slime's routing replay and for ``megatron.freeze_router``). At every verified weight
sync the probe batch is routed by both sides and compared per (layer, real token):

- ``rollout/moe_routing_agreement``: the share of tokens whose top-k expert *set* is the same;
- ``rollout/moe_routing_overlap``: the mean share of the k experts the two sides have in common.

Trainer side (``RoutingRecorder``): a forward hook on every Megatron router records its routing map while a
no-grad forward of the probe runs; the engine tells it, before each micro-batch, which batch rows the micro-batch
holds and how their tokens are laid out (padded rows with the real tokens first, or a THD pack), so each token's
choice is stored by (layer, batch row, position). Each pipeline stage records its own layers; ``gathered``
merges every rank's. Layouts whose router sees only part of a row's tokens (sequence or context parallelism)
record nothing, and the metric is left out. Engine side: ``HFEngine.expert_choices`` (transformers' router
logits, top-k).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from megatron_rl.models.moe_training import _routers

__all__ = ["RoutingRecorder", "recording_routing", "routing_agreement"]

log = logging.getLogger(__name__)

# layer (0-based, global) -> batch row -> [tokens of the row, experts] bool (True: the token's top-k experts)
Routing = dict[int, dict[int, torch.Tensor]]


class RoutingRecorder:
    """The routing of every real token of the forwards run while it is installed (see the module docstring)."""

    def __init__(self, chunks: list[torch.nn.Module]) -> None:
        self.choices: Routing = {}
        self.unsupported: str | None = None  # why this rank could not record (its router saw partial rows)
        self._layout: tuple[list[int], torch.Tensor, bool] | None = None
        self._handles = [r.register_forward_hook(self._hook(r.layer_number - 1)) for r in _routers(chunks)]

    def expect(self, micro_batch: Any) -> None:
        """The next forward is of ``micro_batch`` (a ``workers.packing.PackedMicroBatch``)."""
        rows = micro_batch.rows.tolist()
        if micro_batch.is_shared:  # a row's prompt tokens are routed once for its whole group
            self.unsupported = "the probe's prompts were shared (megatron.share_prompts)"
            self._layout = None
        elif micro_batch.is_thd:
            self._layout = (rows, micro_batch.cu_seqlens.cpu(), True)
        else:
            self._layout = (rows, micro_batch.attention_mask.cpu(), False)

    def _hook(self, layer: int):
        def record(module, inputs, output) -> None:
            if self._layout is None or self.unsupported is not None:
                return
            rows, layout, thd = self._layout
            routing_map = output[1].detach().cpu()  # [tokens, experts], Megatron's token order
            expected = int(layout[-1]) if thd else layout.numel()
            if routing_map.shape[0] < expected:
                self.unsupported = (f"the router of layer {layer} saw {routing_map.shape[0]} of {expected} tokens "
                                    "(sequence or context parallel)")
                return
            per_layer = self.choices.setdefault(layer, {})
            if thd:  # the rows' real tokens end to end, in order
                for i, row in enumerate(rows):
                    per_layer[row] = routing_map[int(layout[i]) : int(layout[i + 1])]
                return
            width, count = layout.shape[1], layout.shape[0]
            by_position = routing_map.view(width, count, -1)  # [seq, batch] order; real tokens first in each row
            for j, row in enumerate(rows):
                per_layer[row] = by_position[: int(layout[j].sum()), j]
        return record

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def gathered(self) -> Routing | None:
        """Every rank's choices merged (a collective over the default group): each stage's layers; None when some
        rank could not record (its reason is logged once)."""
        import torch.distributed as dist

        mine = (self.choices, self.unsupported)
        everyone = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        reasons = [reason for _, reason in everyone if reason is not None]
        if reasons:
            log.warning("no routing agreement metric: %s", reasons[0])
            return None
        merged: Routing = {}
        for choices, _ in everyone:
            for layer, rows in choices.items():
                for row, choice in rows.items():
                    merged.setdefault(layer, {}).setdefault(row, choice)
        return merged


@contextlib.contextmanager
def recording_routing(engine: Any) -> Iterator[RoutingRecorder]:
    """Record the routing of the forwards ``engine`` (a ``workers.engine.MegatronEngine``) runs inside the block."""
    recorder = RoutingRecorder(engine.model)
    engine.routing_recorder = recorder
    try:
        yield recorder
    finally:
        engine.routing_recorder = None
        recorder.close()


def routing_agreement(trainer: Routing, engine: Routing) -> dict[str, float]:
    """Compare the engine's routing of the probe rows with the trainer's (same rows, same real tokens)."""
    same = tokens = 0
    shared = 0.0
    for layer, rows in sorted(engine.items()):
        for row, theirs in sorted(rows.items()):
            ours = trainer.get(layer, {}).get(row)
            if ours is None or ours.shape != theirs.shape:
                raise RuntimeError(
                    f"routing agreement: the trainer routed {None if ours is None else tuple(ours.shape)} tokens x "
                    f"experts of probe row {row} at layer {layer}, the rollout engine {tuple(theirs.shape)}"
                )
            same += int((ours == theirs).all(dim=-1).sum())
            shared += float(((ours & theirs).sum(dim=-1) / theirs.sum(dim=-1).clamp(min=1)).sum())
            tokens += theirs.shape[0]
    return {"rollout/moe_routing_agreement": same / max(tokens, 1), "rollout/moe_routing_overlap": shared / max(tokens, 1)}
