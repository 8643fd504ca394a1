"""The PPO update loop shared by the actor and the critic: epochs x mini-batches x micro-batches.

Batch sizes follow verl: ``ppo_mini_batch_size`` counts prompts, so a mini-batch holds
``ppo_mini_batch_size * rollout.n`` responses globally, of which each data-parallel rank holds
``ppo_mini_batch_size * rollout.n / DP`` (its shard). One optimizer step per mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from megatron_rl.algos import GlobalBatchInfo
from megatron_rl.protocol import DataProto
from megatron_rl.workers.engine import MegatronEngine, StepFn
from megatron_rl.workers.forward import pack_batch
from megatron_rl.workers.metrics import reduce_mini_batch
from megatron_rl.workers.micro_batches import MicroBatchSpec


@dataclass(frozen=True)
class UpdateSchedule:
    mini_batch_rows: int  # responses per mini-batch on this DP rank
    ppo_epochs: int
    shuffle: bool
    seed: int

    @classmethod
    def create(
        cls, prefix: str, ppo_mini_batch_size: int, rollout_n: int, ppo_epochs: int, shuffle: bool, seed: int
    ) -> UpdateSchedule:
        for key, value in (("ppo_mini_batch_size", ppo_mini_batch_size), ("ppo_epochs", ppo_epochs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{prefix}.{key} must be a positive int, got {value!r}")
        if not isinstance(rollout_n, int) or rollout_n < 1:
            raise ValueError(f"rollout.n must be a positive int, got {rollout_n!r}")
        dp = parallel_state.get_data_parallel_world_size()
        responses = ppo_mini_batch_size * rollout_n
        if responses % dp:
            raise ValueError(
                f"{prefix}.ppo_mini_batch_size * rollout.n = {ppo_mini_batch_size} * {rollout_n} = "
                f"{responses} responses per mini-batch do not split over {dp} data-parallel ranks"
            )
        return cls(responses // dp, ppo_epochs, shuffle, seed)

    def mini_batches(self, data: DataProto, update_index: int, where: str) -> Iterator[DataProto]:
        """Every epoch's mini-batches of this rank's shard (reshuffled per epoch when ``shuffle``)."""
        rows = len(data)
        if rows == 0 or rows % self.mini_batch_rows:
            raise ValueError(
                f"{where}: this data-parallel rank received {rows} responses, not a positive multiple of its "
                f"mini-batch share ppo_mini_batch_size * rollout.n / DP = {self.mini_batch_rows}"
            )
        for epoch in range(self.ppo_epochs):
            if self.shuffle:
                # Same seed on every rank of a DP group: its TP/PP ranks must agree on the order.
                generator = torch.Generator().manual_seed(
                    self.seed + 7919 * (update_index * self.ppo_epochs + epoch)
                )
                order = torch.randperm(rows, generator=generator)
            else:
                order = torch.arange(rows)
            for start in range(0, rows, self.mini_batch_rows):
                yield data[order[start : start + self.mini_batch_rows]]


def train_mini_batch(
    engine: MegatronEngine,
    mini_batch: DataProto,
    spec: MicroBatchSpec,
    field_keys: Sequence[str],
    make_step: Callable[[GlobalBatchInfo], StepFn],
    budget_name: str,
) -> tuple[dict[str, float], float]:
    """One optimizer step on ``mini_batch``; returns (its reduced metrics, gradient norm).

    The loss normalisers (valid tokens, non-empty sequences) are counted over the whole global
    mini-batch (all-reduced over DP) before any micro-batch runs: ``make_step`` receives them.
    """
    micro_batches = pack_batch(engine, mini_batch, spec, field_keys, budget_name)
    mask = mini_batch.batch["response_mask"].to(engine.device)
    global_batch = GlobalBatchInfo.from_masks([mask], dp_group=engine.dp_group)
    engine.zero_grad()
    per_micro = engine.run(micro_batches, make_step(global_batch), forward_only=False)
    grad_norm = engine.optimizer_step()
    return reduce_mini_batch(engine, per_micro), grad_norm
