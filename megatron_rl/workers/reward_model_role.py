"""RewardModelRole: scalar scores of whole sequences from a frozen value-head engine (the reward model).

A ``*ForSequenceClassification`` checkpoint loads as the critic's value model (``score.weight`` is the
value head, no bias); the score of a sequence is the head's output at its last real token, as
transformers reads it. The rows come as RM token rows (``RewardModelInputs``): ``input_ids`` and
``attention_mask`` [B, L], any padding. Micro-batches follow ``micro_batch_size_per_gpu`` or the token
budget ``forward_max_token_len_per_gpu`` (``use_dynamic_bsz``), packed like every other forward pass.
"""

from __future__ import annotations

import torch

from megatron_rl.config.schema import RewardModelConfig
from megatron_rl.protocol import DataProto
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.forward import pack_batch
from megatron_rl.workers.micro_batches import MicroBatchSpec
from megatron_rl.workers.packing import PackedMicroBatch

PREFIX = "reward_model"


def last_token_outputs(output: torch.Tensor, micro_batch: PackedMicroBatch) -> torch.Tensor:
    """[b] fp32: the head's output at each row's last real token ([b', W, 1], or [1, T, 1] for THD)."""
    if micro_batch.is_thd:  # (under context parallelism every CP rank gets all b scores)
        return micro_batch.take(output[..., 0], micro_batch.last_index).float()
    lengths = micro_batch.attention_mask[: micro_batch.num_rows].long().sum(dim=1)
    rows = torch.arange(micro_batch.num_rows, device=output.device)
    return output[rows, lengths - 1, 0].float()


def check_rm_rows(data: DataProto, where: str) -> None:
    """RM rows: input_ids and attention_mask [B, L], every row with at least one real token."""
    data.require("input_ids", "attention_mask", where=where)
    ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(
            f"{where}: input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be [B, L]"
        )
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{where}: rows {empty[:8]} have no real token (attention_mask all 0); nothing to score")


class RewardModelRole:
    """Args:
    engine: a frozen ``MegatronEngine`` built with ``value_head=True`` from the RM checkpoint.
    config: ``RewardModelConfig`` (``reward_model``): micro_batch_size_per_gpu, use_dynamic_bsz,
        forward_max_token_len_per_gpu.
    """

    def __init__(self, engine: MegatronEngine, config: RewardModelConfig) -> None:
        if engine.trainable or not engine.value_head:
            raise ValueError("RewardModelRole needs a frozen MegatronEngine built with value_head=True")
        self.engine = engine
        self.spec = MicroBatchSpec(
            config.micro_batch_size_per_gpu, config.use_dynamic_bsz, config.forward_max_token_len_per_gpu
        )

    def compute_rm_score(self, data: DataProto) -> DataProto:
        """{"rm_scores": [B] fp32}, identical on every rank of the model-parallel group."""
        check_rm_rows(data, "compute_rm_score")
        self.engine.offload.enter("compute")
        ids = data.batch["input_ids"]
        # Packing wants a response part; an RM row is scored as a whole, so the part is empty.
        rows = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": data.batch["attention_mask"], "responses": ids[:, :0]}
        )
        micro_batches = pack_batch(self.engine, rows, self.spec, (), f"{PREFIX}.forward_max_token_len_per_gpu")

        def step(output: torch.Tensor, micro_batch: PackedMicroBatch):
            return output.new_zeros((), dtype=torch.float32), last_token_outputs(output, micro_batch)

        results = self.engine.run(micro_batches, step, forward_only=True)
        scores = None
        if self.engine.is_last_stage:
            scores = torch.zeros(len(rows), dtype=torch.float32, device=self.engine.device)
            for micro_batch, result in zip(micro_batches, results, strict=True):
                scores[micro_batch.rows] = result
        scores = self.engine.broadcast_from_last_stage(scores, (len(rows),), torch.float32)
        self.engine.offload.enter("generate")  # with param_offload the RM leaves the GPU until the next scoring
        return DataProto.from_dict({"rm_scores": scores.cpu()})
