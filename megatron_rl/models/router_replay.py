"""MoE routing replay: the trainer's routers use the experts another pass chose (verl's ``router_replay.mode``).

The routing of a token is discrete: a router logit that moves a little between the rollout engine and the
trainer (other kernels, other precision) can send the token to another expert, and its log-prob then comes
from another sub-network. Replay removes that source of mismatch:

- R3: the rollout engine reports, per token and MoE layer, the top-k experts it used (``batch['routed_experts']``,
  [B, S, L, k] integer, aligned with ``input_ids``; -1 where the engine did not route the token, e.g. the last
  sampled token, which it never fed back); the old-log-prob, reference and update passes replay them.
- R2: the old-log-prob pass records the trainer's own routing into ``routed_experts``; the update passes replay
  it (the routing stays fixed while the weights move over the mini-batches of one step).

Replay goes through Megatron-Core's ``RouterReplay`` (the hook its ``topk_routing_with_score_function`` calls):
the replayed indices replace the top-k, and the routing probabilities are the router's scores gathered at
them (softmax over the gathered logits, or the gathered softmax with ``moe_router_pre_softmax``), so gradients
reach the router weights through the chosen experts' scores only, as in Megatron. Tokens without a replayed
choice (-1, padding) keep the router's own top-k.

Scheduling: the engine tells ``RoutingReplay`` each micro-batch before its forward (``expect``); each router
takes its targets from a queue in forward order. Under activation recompute a checkpointed layer's router
runs again in the backward pass (grad enabled, after its first forward ran without grad); those calls take
the micro-batch's targets from a second queue, in the same order (the pipeline schedules run backwards in
forward order).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from megatron_rl.models.moe_training import _routers

if TYPE_CHECKING:  # the schema imports Hydra, which this module does not need at run time
    from megatron_rl.config.schema import MegatronParallelConfig
    from megatron_rl.models.hf_config import HFModelConfig

__all__ = [
    "MODES",
    "ROUTED_EXPERTS",
    "RoutingReplay",
    "check_routed_experts",
    "left_justify",
    "routed_experts_from_choices",
]

ROUTED_EXPERTS = "routed_experts"  # verl's batch key
MODES = ("disabled", "R2", "R3")
MODE_KEY = "actor_rollout_ref.actor.megatron.router_replay.mode"


def check_routed_experts(routed: torch.Tensor, input_ids: torch.Tensor, num_layers: int, topk: int,
                         num_experts: int, where: str) -> None:
    """Refuse a ``routed_experts`` tensor that does not fit the batch and the model, naming the shapes."""
    expected = (*input_ids.shape, num_layers, topk)
    if tuple(routed.shape) != expected:
        raise ValueError(f"{where}: batch['{ROUTED_EXPERTS}'] has shape {tuple(routed.shape)}, expected {expected} "
                         "(rows, input_ids columns, MoE layers, top-k)")
    if routed.dtype.is_floating_point or routed.dtype == torch.bool:
        raise ValueError(f"{where}: batch['{ROUTED_EXPERTS}'] must hold integer expert ids, got {routed.dtype}")
    low, high = int(routed.min()), int(routed.max())
    if low < -1 or high >= num_experts:
        raise ValueError(f"{where}: batch['{ROUTED_EXPERTS}'] holds expert ids in [{low}, {high}]; the model has "
                         f"{num_experts} experts (-1: not routed)")


def left_justify(routed: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S, L, k] -> the same with each row's real tokens first, in order, -1 after (the packed layout's)."""
    real = attention_mask.bool()
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices
    index = order[:, :, None, None].expand_as(routed)
    out = routed.gather(1, index)
    return out.masked_fill(~real.gather(1, order)[:, :, None, None], -1)


def routed_experts_from_choices(choices: dict[int, dict[int, torch.Tensor]], attention_mask: torch.Tensor,
                                num_layers: int, topk: int) -> torch.Tensor:
    """{layer: {row: [real tokens, E] bool}} (the trainer's recorded routing) -> [B, S, L, k] int16, -1 where
    no layer recorded the token."""
    real = attention_mask.bool()
    out = torch.full((*real.shape, num_layers, topk), -1, dtype=torch.int16)
    for layer, rows in choices.items():
        for row, chosen in rows.items():
            ids = chosen.nonzero()[:, 1].view(chosen.shape[0], topk)  # k True per token, ascending ids
            out[row, real[row].nonzero()[:, 0], layer] = ids.to(torch.int16)
    return out


def _replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
    """``RouterReplay.get_replay_topk`` for a per-token target: rows with a target (no -1) take it, the others
    keep the router's own top-k; probabilities are the scores at the chosen ids (Megatron's replay)."""
    target = self.target_topk_idx
    if target is None:
        return default_compute_topk(scores, topk, num_groups, group_topk)
    _, own = default_compute_topk(scores, topk, num_groups, group_topk)
    target = target.to(device=scores.device, dtype=own.dtype)
    replayed = (target >= 0).all(dim=-1, keepdim=True)
    tally = getattr(self, "tally", None)
    if tally is not None:  # how often the router's own top-k set was the replayed one
        same = (own.sort(dim=-1).values == target.sort(dim=-1).values).all(dim=-1) & replayed[:, 0]
        tally += torch.stack([same.sum(), replayed.sum()]).to(tally)
    indices = torch.where(replayed, target, own)
    return scores.gather(1, indices), indices


class RoutingReplay:
    """Replays given routing in every router of ``chunks`` (one model's chunks on this rank); see the module
    docstring. ``expect`` before each micro-batch's forward, between ``begin`` and ``end`` of one run."""

    def __init__(self, chunks: list[torch.nn.Module], topk: int) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.topk = topk
        self.routers = _routers(chunks)
        self._forward: dict[int, deque] = {}
        self._recompute: dict[int, deque] = {}
        self._checkpointed: set[int] = set()
        self._training = False
        self._active = False
        # [same, replayed] (token, layer) pairs of the training forwards since the last metrics()
        device = self.routers[0].weight.device if self.routers else torch.device("cpu")
        self.counts = torch.zeros(2, dtype=torch.float64, device=device)
        for router in self.routers:
            replay = RouterReplay.__new__(RouterReplay)  # not in Megatron's global list: this engine schedules it
            replay.target_topk_idx = replay.recorded_topk_idx = replay.router_replay_action = None
            replay.replay_backward_list = []
            replay.get_replay_topk = _replay_topk.__get__(replay)
            router.router_replay = replay
            router.register_forward_pre_hook(self._pre_forward(router))

    def begin(self, training: bool) -> None:
        self._training, self._active = training, True
        self._forward = {id(r): deque() for r in self.routers}
        self._recompute = {id(r): deque() for r in self.routers}

    def end(self) -> None:
        """Every queued target consumed (a leftover means the schedule ran the routers otherwise than assumed)."""
        self._active = False
        left = sum(len(q) for q in (*self._forward.values(), *self._recompute.values()))
        for router in self.routers:
            router.router_replay.target_topk_idx = None
        if left:
            raise RuntimeError(f"routing replay: {left} router calls expected but not run (pipeline schedule?)")

    def metrics(self) -> dict[str, float]:
        """``moe_replay_agreement``: the share of replayed (token, layer) pairs of the training passes since the
        last call whose own top-k set was the replayed one (what routing agreement would be without replay); {}
        when nothing was replayed. A collective over all ranks."""
        import torch.distributed as dist

        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        same, total = counts.tolist()
        return {"moe_replay_agreement": same / total} if total else {}

    def expect(self, micro_batch: Any) -> None:
        """Queue the targets of ``micro_batch`` (a ``workers.packing.PackedMicroBatch``; its ``fields`` carry
        the rows' ``routed_experts``, left-justified) for every router; none when it carries no routing."""
        routed = micro_batch.fields.get(ROUTED_EXPERTS)
        tokens = None if routed is None else self._token_order(micro_batch, routed)
        for router in self.routers:
            target = None if tokens is None else tokens[:, router.layer_number - 1]
            self._forward[id(router)].append(target)

    def _token_order(self, micro_batch: Any, routed: torch.Tensor) -> torch.Tensor:
        """[rows, S, L, k] (real tokens first) -> [tokens, L, k] in Megatron's token order for this rank."""
        from megatron.core import parallel_state

        if micro_batch.is_shared or micro_batch.cp is not None:
            raise ValueError(f"{MODE_KEY}: routing replay does not support shared prompts or context parallelism")
        layers, k = routed.shape[2], routed.shape[3]
        if micro_batch.is_thd:
            size = micro_batch.input_ids.shape[1]
            out = routed.new_full((size, layers, k), -1)
            bounds = micro_batch.cu_seqlens.tolist()
            for j in range(routed.shape[0]):
                length = bounds[j + 1] - bounds[j]
                out[bounds[j] : bounds[j + 1]] = routed[j, :length]
        else:
            count, width = micro_batch.input_ids.shape
            out = routed.new_full((width, count, layers, k), -1)  # [seq, batch]
            cols = min(width, routed.shape[1])
            out[:cols, : routed.shape[0]] = routed[:, :cols].transpose(0, 1)
            out = out.reshape(width * count, layers, k)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp > 1 and getattr(self.routers[0].config, "sequence_parallel", False):  # this TP rank's slice
            share = out.shape[0] // tp
            rank = parallel_state.get_tensor_model_parallel_rank()
            out = out[rank * share : (rank + 1) * share]
        return out

    def _pre_forward(self, router: torch.nn.Module):
        def hook(module, args) -> None:
            replay = router.router_replay
            if not self._active:
                replay.target_topk_idx = None
                return
            key = id(router)
            grad = torch.is_grad_enabled()
            replay.tally = None
            if self._training and grad and key in self._checkpointed:  # activation recompute in the backward
                replay.target_topk_idx = self._recompute[key].popleft()
                return
            if self._training:
                replay.tally = self.counts
            if self._training and not grad:  # a training forward without grad: inside a checkpoint
                self._checkpointed.add(key)
            if not self._forward[key]:
                raise RuntimeError(f"routing replay: router of layer {router.layer_number} ran without a micro-batch")
            replay.target_topk_idx = target = self._forward[key].popleft()
            if self._training and key in self._checkpointed:
                self._recompute[key].append(target)
        return hook


def replay_mode(parallel: MegatronParallelConfig, where: str) -> str:
    """``<where>.router_replay.mode`` checked (verl's values; its file options are refused: not built)."""
    config = getattr(parallel, "router_replay", None)
    if config is None:
        return "disabled"
    mode = str(config.mode)
    if mode not in MODES:
        raise ValueError(f"{where}.router_replay.mode={mode!r} must be one of {', '.join(MODES)}")
    for key in ("record_file", "replay_file"):
        if getattr(config, key, None):
            raise ValueError(f"{where}.router_replay.{key}={getattr(config, key)!r}: routing to or from files is "
                             "not supported (the routing travels with the batch); leave it null")
    return mode


def build_routing_replay(
    chunks: list[torch.nn.Module], parallel: MegatronParallelConfig, hf_config: HFModelConfig, where: str
) -> RoutingReplay | None:
    """The engine's RoutingReplay when ``<where>.router_replay.mode`` is R2 or R3, else None; refused, naming the
    key, for a dense model and for layouts whose routers see tokens replay cannot place."""
    mode = replay_mode(parallel, where)
    if mode == "disabled":
        return None
    if getattr(hf_config, "moe", None) is None:
        raise ValueError(f"{where}.router_replay.mode={mode} needs an MoE model (this one has no router)")
    if int(getattr(parallel, "context_parallel_size", 1) or 1) > 1:
        raise ValueError(f"{where}.router_replay.mode={mode} is not supported with context_parallel_size > 1")
    if getattr(parallel, "share_prompts", False):
        raise ValueError(f"{where}.router_replay.mode={mode} is not supported with {where}.share_prompts=true")
    if any(router.config.moe_router_fusion for router in _routers(chunks)):  # the routers as built
        # Megatron-Core 0.16.1 moe_utils.topk_routing_with_score_function returns the fused top-k before
        # compute_topk, the only call of the replay hook: the replay would be skipped without a word
        raise ValueError(f"{where}.router_replay.mode={mode} with {where}.override_transformer_config."
                         "moe_router_fusion=true: the fused router takes its top-k before the replay hook; set it "
                         "false")
    return RoutingReplay(chunks, hf_config.moe.topk)
