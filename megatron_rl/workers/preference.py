"""Preference training (DPO, IPO, SimPO) on a trainable MegatronEngine: the DPO role and its worker (issue 55;
docs/dpo.md).

A batch is data/preference.py's: 2B rows in the SFT layout, pair i's chosen and rejected sides marked by
``pair_index`` and ``chosen``. The loss couples a pair's two rows, but micro-batching, packing and data parallelism
split batches anywhere. So one optimizer step runs three passes, exactly and whatever the split:

1. forward only: every row's sequence log-prob under the policy, logp_r = sum (or, for ipo / simpo, mean) of its
   response tokens' log-probs; and once per batch the reference's (a frozen engine, or the actor with its LoRA
   adapters off);
2. on the whole batch (gathered over data-parallel ranks: [2B] numbers): the preference loss L (algos/preference.py
   ``compute_preference_loss``) and by autograd on that small tensor its derivative c_r = dL / d logp_r;
3. training: ``train_mini_batch`` back-propagates the surrogate S = sum_r c_r * logp_r, c_r held constant. Its
   gradient is sum_r c_r * d logp_r / d theta = dL / d theta by the chain rule: the same trick as a policy
   gradient's advantages, which weight each token's log-prob by a number computed outside the graph. S is linear in
   the token log-probs, so it splits over micro-batches and ranks like the SFT loss; the gradient is the DPO loss's
   exactly when pass 3's forward equals pass 1's (no dropout: the models here have none).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from megatron_rl.algos import GlobalBatchInfo
from megatron_rl.algos.loss_agg import masked_sum
from megatron_rl.algos.preference import preference_pair_loss, sequence_log_probs
from megatron_rl.config import PPOTrainerConfig
from megatron_rl.config.preference_schema import DPOConfig, length_normalised, loss_kwargs, reference_free
from megatron_rl.controller import Dispatch, register
from megatron_rl.controller.deadlines import collective_timeout_s
from megatron_rl.protocol import DataProto
from megatron_rl.workers.batch_checks import check_batch
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.forward import compute_log_probs, response_log_probs
from megatron_rl.workers.metrics import StepMetrics
from megatron_rl.workers.micro_batches import MicroBatchSpec
from megatron_rl.workers.packing import PackedMicroBatch
from megatron_rl.workers.reference import ReferenceRole
from megatron_rl.workers.routing_replay import reference_parallel
from megatron_rl.workers.sft import SFTRole, SFTWorker
from megatron_rl.workers.update_loop import train_mini_batch

__all__ = ["DPORole", "DPOWorker", "build_reference"]

FIELDS = ("response_mask", "pair_index", "chosen")
WEIGHT = "dpo_token_weight"  # [B, R]: c_r on each response token of row r (divided by its length when normalised)


def _gather(rows: DataProto, group: dist.ProcessGroup) -> tuple[dict[str, torch.Tensor], slice]:
    """This data-parallel rank's [n] columns concatenated with the other ranks' (rank order: the batch's order), in
    one exchange, and where its own rows sit in the result."""
    parts: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, {key: rows.batch[key].cpu() for key in rows.batch.keys()}, group=group)
    start = sum(len(p["chosen"]) for p in parts[:dist.get_rank(group)])
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}, slice(start, start + len(rows))


class DPORole(SFTRole):
    """``engine``: trainable (micro-batching from ``actor_rollout_ref.actor``, as SFT); ``reference``: the reference
    policy's role, None for the reference-free simpo; ``dpo``: the loss (config/preference_schema.py)."""

    def __init__(self, engine: MegatronEngine, micro_batch: MicroBatchSpec, reference: ReferenceRole | None,
                 dpo: DPOConfig) -> None:
        super().__init__(engine, micro_batch)
        if (reference is None) != reference_free(dpo.loss_type):
            raise ValueError(f"loss_type={dpo.loss_type} {'takes no' if reference is None else 'needs a'} reference "
                             f"(got {reference!r})")
        self.reference, self.dpo = reference, dpo
        self.average = length_normalised(dpo.loss_type)

    def sequence_log_probs(self, data: DataProto) -> DataProto:
        """{"policy_logps", "ref_logps" (0 for simpo), "pair_index", "chosen"}: [B] per row (forward only)."""
        check_batch(data, FIELDS, "dpo sequence_log_probs")
        mask = data.batch["response_mask"]
        self.engine.offload.enter("compute")
        tokens = compute_log_probs(self.engine, data, self.spec, 1.0, False, self.budget_key)["log_probs"]
        policy = sequence_log_probs(tokens, mask, self.average)
        reference = torch.zeros_like(policy)
        if self.reference is not None:
            with_temperature = DataProto.from_parts(data.batch, data.non_tensor_batch, {"temperature": 1.0})
            ref_tokens = self.reference.compute_ref_log_prob(with_temperature).batch["ref_log_prob"]
            reference = sequence_log_probs(ref_tokens, mask, self.average)
        return DataProto.from_dict({"policy_logps": policy, "ref_logps": reference,
                                    "pair_index": data.batch["pair_index"], "chosen": data.batch["chosen"]})

    def _surrogate_step(self, global_batch: GlobalBatchInfo, logits: torch.Tensor,
                        micro_batch: PackedMicroBatch) -> tuple[torch.Tensor, StepMetrics]:
        mask = micro_batch.fields["response_mask"]
        log_probs, _ = response_log_probs(self.engine, logits, micro_batch, 1.0, with_entropy=False)
        surrogate = masked_sum(log_probs * micro_batch.fields[WEIGHT], mask)
        return surrogate, StepMetrics(float(mask.sum()), {}, {})

    def train_batch(self, data: DataProto) -> DataProto:
        """One optimizer step on this rank's shard of the batch (module docstring); metrics train/loss (the global
        batch's mean preference loss), train/rewards/{chosen,rejected,margins,accuracies}, train/logps/{chosen,
        rejected}, train/grad_norm, train/lr, identical on every rank."""
        rows = self.sequence_log_probs(data)
        every, own = _gather(rows, self.engine.dp_group)
        loss, pair_metrics, coefficients = preference_pair_loss(
            every["policy_logps"], None if self.reference is None else every["ref_logps"], every["pair_index"],
            every["chosen"], **loss_kwargs(self.dpo))
        mask = data.batch["response_mask"].float()
        per_token = coefficients[own].unsqueeze(-1) * mask
        if self.average:  # d mean / d token = 1 / (the row's response tokens)
            per_token = per_token / mask.sum(-1, keepdim=True).clamp_min(1.0)
        training = DataProto.from_parts(data.batch.clone(), data.non_tensor_batch, dict(data.meta_info))
        training.batch[WEIGHT] = per_token
        self.engine.offload.enter("update")
        _, grad_norm = train_mini_batch(self.engine, training, self.spec, ("response_mask", WEIGHT),
                                        lambda global_batch: functools.partial(self._surrogate_step, global_batch),
                                        self.budget_key)
        self.engine.scheduler_step()
        self.updates_done += 1
        metrics = {"train/loss": loss, **{f"train/{k}": v for k, v in pair_metrics.items()},
                   "train/grad_norm": grad_norm, "train/lr": self.engine.lr}
        return DataProto(meta_info={"metrics": metrics})


def build_reference(config: PPOTrainerConfig, engine: MegatronEngine) -> ReferenceRole | None:
    """The reference policy ``dpo.reference`` asks for (module docstring); None for the reference-free simpo."""
    arr, dpo = config.actor_rollout_ref, config.dpo
    if reference_free(dpo.loss_type):
        return None
    if str(dpo.reference) == "adapters_off" or (str(dpo.reference) == "auto" and engine.lora is not None):
        return ReferenceRole(engine, arr.ref, adapters_off=True)
    ref_engine = MegatronEngine(arr.model.path, reference_parallel(arr.actor.megatron, arr.ref.megatron), None,
                                name="actor_rollout_ref.ref", override_config=arr.model.override_config)
    return ReferenceRole(ref_engine, arr.ref)


class DPOWorker(SFTWorker):
    """One rank of a DPO run: SFTWorker's engine, checkpoints and HF export, with the DPO role and its reference."""

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
        self.role = DPORole(engine, spec, build_reference(self.config, engine), self.config.dpo)
        self.set_mesh(**engine.mesh_kwargs())

    @register(Dispatch.MEGATRON_COMPUTE_PROTO)
    def sequence_log_probs(self, data: DataProto) -> DataProto:
        return self.role.sequence_log_probs(data)
