"""Supervised fine-tuning on a trainable MegatronEngine: the SFT role and its worker (issue 55; docs/sft.md).

An SFT batch uses the RL batch's layout (data/sft.py ``sft_batch``): the conversation's first token is the
"prompt" and the rest the "response", with ``response_mask`` on the assistant's tokens. So the log-prob pass,
packing, micro-batching, TP/PP/CP and the update loop are the actor's (workers/forward.py, update_loop.py); only
the loss differs: the negative log-likelihood of the masked tokens, averaged over the global batch's masked
tokens (verl's SFT loss, ``loss_agg_mode=token-mean``). One optimizer step per training batch.
"""

from __future__ import annotations

import functools

import torch

from megatron_rl.algos import GlobalBatchInfo, agg_loss
from megatron_rl.config import PPOTrainerConfig
from megatron_rl.controller import Dispatch, Worker, register
from megatron_rl.controller.deadlines import collective_timeout_s
from megatron_rl.protocol import DataProto
from megatron_rl.workers.batch_checks import check_batch
from megatron_rl.workers.checkpoint import CheckpointedRole
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.forward import compute_log_probs, response_log_probs
from megatron_rl.workers.metrics import StepMetrics
from megatron_rl.workers.micro_batches import MicroBatchSpec
from megatron_rl.workers.packing import PackedMicroBatch
from megatron_rl.workers.update_loop import train_mini_batch

__all__ = ["SFTRole", "SFTWorker"]

FIELDS = ("response_mask",)


class SFTRole(CheckpointedRole):
    """``engine``: trainable; micro-batching from ``actor_rollout_ref.actor`` (``ppo_micro_batch_size_per_gpu``,
    ``use_dynamic_bsz``, ``ppo_max_token_len_per_gpu``), as verl's SFT ``data.micro_batch_size_per_gpu`` etc."""

    prefix = "actor_rollout_ref.actor"

    def __init__(self, engine: MegatronEngine, micro_batch: MicroBatchSpec) -> None:
        if not engine.trainable or engine.value_head:
            raise ValueError("SFTRole needs a trainable causal-LM MegatronEngine (built with an optim config)")
        self.engine, self.spec = engine, micro_batch
        self.budget_key = f"{self.prefix}.ppo_max_token_len_per_gpu"
        self.updates_done = 0

    def _nll_step(self, global_batch: GlobalBatchInfo, logits: torch.Tensor,
                  micro_batch: PackedMicroBatch) -> tuple[torch.Tensor, StepMetrics]:
        mask = micro_batch.fields["response_mask"]
        log_probs, _ = response_log_probs(self.engine, logits, micro_batch, 1.0, with_entropy=False)
        loss = agg_loss(-log_probs, mask, "token-mean", **global_batch.agg_kwargs())
        return loss, StepMetrics(float(mask.sum()), {"train/loss": loss.item()}, {})

    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's shard of the batch; metrics train/loss (the global batch's mean NLL
        per assistant token), train/grad_norm, train/lr, identical on every rank."""
        check_batch(data, FIELDS, "sft train_batch")
        self.engine.offload.enter("update")
        metrics, grad_norm = train_mini_batch(self.engine, data, self.spec, FIELDS,
                                              lambda global_batch: functools.partial(self._nll_step, global_batch),
                                              self.budget_key)
        metrics = {"train/loss": metrics["train/loss"], "train/grad_norm": grad_norm, "train/lr": self.engine.lr}
        self.engine.scheduler_step()
        self.updates_done += 1
        return DataProto(meta_info={"metrics": metrics})

    def token_log_probs(self, data: DataProto) -> DataProto:
        """{"log_probs": [B, R]} of the response tokens (forward only): the validation loss's terms."""
        check_batch(data, FIELDS, "sft token_log_probs")
        self.engine.offload.enter("compute")
        out = compute_log_probs(self.engine, data, self.spec, 1.0, False, self.budget_key)
        return DataProto.from_dict({"log_probs": out["log_probs"]})


class SFTWorker(Worker):
    """One rank of an SFT run: the model of ``actor_rollout_ref.model`` trained with the actor's layout
    (``actor.megatron``) and optimizer (``actor.optim``); no rollout engine, no reference."""

    def __init__(self, config: PPOTrainerConfig) -> None:
        super().__init__()
        if not isinstance(config, PPOTrainerConfig):
            raise TypeError(f"SFTWorker takes the config as a PPOTrainerConfig, got {type(config).__name__}")
        self.config = config
        self.role: SFTRole | None = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        # the hybrid engine's parallel-state setup (megatron-core: imported by a rank that trains)
        from megatron_rl.workers.hybrid import setup_parallel_state

        arr = self.config.actor_rollout_ref
        actor = arr.actor
        setup_parallel_state(actor.megatron, collective_timeout_s(self.config))
        engine = MegatronEngine(arr.model.path, actor.megatron, actor.optim, name=SFTRole.prefix,
                                override_config=arr.model.override_config, lora=arr.model.lora, mtp=arr.model.mtp)
        spec = MicroBatchSpec(actor.ppo_micro_batch_size_per_gpu, actor.use_dynamic_bsz,
                              actor.ppo_max_token_len_per_gpu)
        self.role = SFTRole(engine, spec)
        self.set_mesh(**engine.mesh_kwargs())

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def train_batch(self, data: DataProto) -> DataProto:
        return self.role.train_batch(data)

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def token_log_probs(self, data: DataProto) -> DataProto:
        return self.role.token_log_probs(data)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        self.role.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.role.load_checkpoint(path)

    @register(Dispatch.RANK_ZERO)
    def save_hf(self, path: str) -> None:
        """Collective export; global rank 0 writes the directory (an HF checkpoint the RL trainer takes)."""
        from megatron_rl.weights import save_hf_checkpoint  # megatron-core: the weight export

        self.role.engine.offload.enter("compute")
        save_hf_checkpoint(self.role.engine.model, path,
                           tokenizer_dir=self.config.data.tokenizer or self.config.actor_rollout_ref.model.path)
