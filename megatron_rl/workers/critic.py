"""CriticRole: values of the response tokens and clipped value-loss updates on a value-head engine.

The value of response token t is the head's output at the token before it (the state in which t was
generated), as in verl. Same dispatch contract as the actor: each rank gets its DP shard, results
are identical on every rank of a data-parallel group.
"""

from __future__ import annotations

import functools

import torch

from megatron_rl.algos import GlobalBatchInfo, compute_value_loss
from megatron_rl.config.schema import CriticConfig
from megatron_rl.ops import masked_mean
from megatron_rl.protocol import DataProto
from megatron_rl.workers.batch_checks import check_batch
from megatron_rl.workers.checkpoint import CheckpointedRole
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.forward import forward_per_token, response_values
from megatron_rl.workers.metrics import StepMetrics, mean_over_steps
from megatron_rl.workers.micro_batches import MicroBatchSpec
from megatron_rl.workers.packing import PackedMicroBatch
from megatron_rl.workers.update_loop import UpdateSchedule, train_mini_batch

UPDATE_FIELDS = ("response_mask", "values", "returns")


class CriticRole(CheckpointedRole):
    """Args:
    engine: a trainable ``MegatronEngine`` built with ``value_head=True``.
    config: ``CriticConfig`` (``critic``).
    rollout_n: responses per prompt (``actor_rollout_ref.rollout.n``).
    ppo_mini_batch_size / ppo_epochs: the actor's values, used where ``config`` leaves them None.
    """

    prefix = "critic"

    def __init__(
        self,
        engine: MegatronEngine,
        config: CriticConfig,
        *,
        rollout_n: int,
        ppo_mini_batch_size: int | None = None,
        ppo_epochs: int | None = None,
    ) -> None:
        if not (engine.trainable and engine.value_head):
            raise ValueError("CriticRole needs a trainable MegatronEngine built with value_head=True")
        self.engine = engine
        self.config = config
        self.schedule = UpdateSchedule.create(
            self.prefix,
            config.ppo_mini_batch_size if config.ppo_mini_batch_size is not None else ppo_mini_batch_size,
            rollout_n,
            config.ppo_epochs if config.ppo_epochs is not None else ppo_epochs,
            False,
            config.megatron.seed,
        )
        self.spec = MicroBatchSpec(
            config.ppo_micro_batch_size_per_gpu, config.use_dynamic_bsz, config.ppo_max_token_len_per_gpu
        )
        self.updates_done = 0

    def compute_values(self, data: DataProto) -> DataProto:
        """{"values": [B, R] fp32}, zero where response_mask is 0 (as verl)."""
        check_batch(data, ("response_mask",), "compute_values")
        self.engine.offload.enter("compute")
        out = forward_per_token(
            self.engine,
            data,
            self.spec,
            lambda output, mb: {"values": response_values(output, mb)},
            ("values",),
            f"{self.prefix}.ppo_max_token_len_per_gpu",
        )
        return DataProto.from_dict({"values": out["values"] * data.batch["response_mask"].float()})

    def _value_step(
        self, global_batch: GlobalBatchInfo, output: torch.Tensor, micro_batch: PackedMicroBatch
    ) -> tuple[torch.Tensor, StepMetrics]:
        fields = micro_batch.fields
        mask = fields["response_mask"]
        vpreds = response_values(output, micro_batch)
        loss, clipfrac = compute_value_loss(
            vpreds,
            fields["returns"],
            fields["values"],
            mask,
            self.config.cliprange_value,
            self.config.loss_agg_mode,
            global_batch,
        )
        token_means = {
            "critic/vf_clipfrac": float(clipfrac),
            "critic/vpred_mean": float(masked_mean(vpreds.detach(), mask)),
        }
        return loss, StepMetrics(float(mask.sum()), {"critic/vf_loss": loss.item()}, token_means)

    def update_critic(self, data: DataProto) -> DataProto:
        """Returns ``DataProto(meta_info={"metrics": {critic/vf_loss, critic/vf_clipfrac, critic/vpred_mean,
        critic/grad_norm, critic/lr}})``, means over the optimizer steps, identical on every rank."""
        check_batch(data, UPDATE_FIELDS, "update_critic")
        self.engine.offload.enter("update")
        steps = []
        for mini_batch in self.schedule.mini_batches(data, self.updates_done, "update_critic"):
            metrics, grad_norm = train_mini_batch(
                self.engine,
                mini_batch,
                self.spec,
                UPDATE_FIELDS,
                lambda global_batch: functools.partial(self._value_step, global_batch),
                f"{self.prefix}.ppo_max_token_len_per_gpu",
            )
            steps.append(metrics | {"critic/grad_norm": grad_norm})
        metrics = mean_over_steps(steps) | {"critic/lr": self.engine.lr}
        self.engine.scheduler_step()
        self.updates_done += 1
        self.engine.offload.enter("after_update")
        return DataProto(meta_info={"metrics": metrics})
