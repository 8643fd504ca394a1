"""The actor's multi-token-prediction loss (``actor_rollout_ref.model.mtp.enable_train``): each micro-batch's targets
in the layout the model reads (models/mtp_model.py ``MTPTargets``), and the logged losses.

Targets as verl's MTP training sets them: depth k at position p predicts the token k + 1 ahead; a position counts
when that token is a response token the loss covers (``response_mask``: a tool's output in a multi-turn response
does not), and p is inside the token's own sequence (THD packs) or row. The loss weighs
``mtp_loss_scaling_factor / depths``, each micro-batch's mean averaged over the mini-batch's micro-batches and DP
ranks (Megatron-Core's normalisation)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_rl.config.schema import MTPConfig
from megatron_rl.models.mtp_model import MTPGPTModel, MTPTargets
from megatron_rl.workers.packing import PackedMicroBatch


def micro_batch_targets(micro_batch: PackedMicroBatch, depths: int, scale: float, detach_encoder: bool) -> MTPTargets:
    """``MTPTargets`` of a padded or THD micro-batch (shared prompts and CP are refused before launch)."""
    mask = micro_batch.fields["response_mask"][micro_batch.token_rows, micro_batch.token_cols] > 0
    labels = micro_batch.labels[mask]
    if micro_batch.is_thd:
        positions = micro_batch.thd_index[mask]
        sequence = torch.searchsorted(micro_batch.cu_seqlens[1:].long(), positions, right=True)
        starts = micro_batch.cu_seqlens[:-1].long()[sequence]
        rows = torch.zeros_like(positions)
    else:
        positions = micro_batch.predictor_cols[mask]
        rows = micro_batch.token_rows[mask]
        starts = torch.zeros_like(positions)  # rows hold their real tokens first (packing.py)
    return MTPTargets.of(tuple(micro_batch.input_ids.shape), rows, positions, labels, starts, depths, scale,
                         detach_encoder)


class MTPTraining:
    """The engine's MTP loss: targets per training micro-batch, metrics after each mini-batch."""

    def __init__(self, config: MTPConfig, depths: int) -> None:
        self.depths = depths
        self.factor = float(config.mtp_loss_scaling_factor)
        self.detach_encoder = bool(config.detach_encoder)

    def set_targets(self, model: MTPGPTModel, micro_batch: PackedMicroBatch, micro_batches: int, dp: int) -> None:
        scale = self.factor / self.depths / (micro_batches * dp)
        model.mtp_targets = micro_batch_targets(micro_batch, self.depths, scale, self.detach_encoder)

    def metrics(self, models: Iterable[torch.nn.Module], dp_group: dist.ProcessGroup,
                device: torch.device) -> dict[str, float]:
        """``mtp_loss/depth_<k>``: the mean cross-entropy of depth k over the mini-batch's targets (all DP ranks),
        and ``mtp_loss``, their mean; {} on stages without the MTP layers."""
        taken = [m.take_mtp_losses() for m in models if isinstance(m, MTPGPTModel) and m.mtp_process]
        if not taken:
            return {}
        totals = torch.stack([sum(t[0] for t in taken), sum(t[1] for t in taken)]).to(device)
        dist.all_reduce(totals, group=dp_group)
        losses = (totals[0] / totals[1].clamp(min=1)).cpu()
        metrics = {f"mtp_loss/depth_{k + 1}": float(v) for k, v in enumerate(losses)}
        return metrics | {"mtp_loss": float(losses.mean())}
