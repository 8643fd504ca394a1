"""ActorRole: old log-probs and PPO policy updates on a trainable MegatronEngine.

Every rank of the role constructs one, after Megatron's parallel state is set up; each rank then
receives the whole DataProto shard of its data-parallel rank (the controller's
MEGATRON_COMPUTE_PROTO dispatch, or the caller under torchrun). Results are the same on every rank
of a data-parallel group (computed on the last pipeline stage, then broadcast along the pipeline).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from megatron_rl.algos import (
    GlobalBatchInfo,
    PolicyLossConfig,
    compute_entropy_loss,
    compute_kl_loss,
    get_policy_loss,
)
from megatron_rl.algos.distillation import DistillationLossConfig, combine_with_task_loss, compute_distillation_loss
from megatron_rl.bucket import WeightBucket
from megatron_rl.config.schema import ActorConfig
from megatron_rl.protocol import DataProto
from megatron_rl.weights.export import ExportPlan, export_hf_buckets
from megatron_rl.models.moe_routing import recording_routing
from megatron_rl.models.router_replay import ROUTED_EXPERTS, replay_mode
from megatron_rl.workers.batch_checks import check_batch, read_temperature
from megatron_rl.workers.routing_replay import recorded_routed_experts, require_routed_experts
from megatron_rl.workers.checkpoint import CheckpointedRole
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.forward import compute_log_probs, response_log_probs
from megatron_rl.workers.metrics import StepMetrics, mean_over_steps
from megatron_rl.workers.micro_batches import MicroBatchSpec
from megatron_rl.workers.packing import PackedMicroBatch
from megatron_rl.workers.teacher import LOG_PROBS as TEACHER_LOG_PROBS, TOPK_IDS, TOPK_LOG_PROBS
from megatron_rl.workers.update_loop import UpdateSchedule, train_mini_batch


class ActorRole(CheckpointedRole):
    """Args:
    engine: a trainable ``MegatronEngine`` (built with the actor's ``optim`` config).
    config: ``ActorConfig`` (``actor_rollout_ref.actor``).
    rollout_n: responses per prompt (``actor_rollout_ref.rollout.n``); mini-batches hold
        ``ppo_mini_batch_size * rollout_n`` responses globally.
    log_prob_micro_batch_size: rows per micro-batch of ``compute_log_prob`` without dynamic
        batching (``rollout.log_prob_micro_batch_size_per_gpu``); default: the training one.
    log_prob_use_dynamic_bsz, log_prob_max_token_len: ``compute_log_prob``'s token budget
        (``rollout.log_prob_use_dynamic_bsz`` / ``log_prob_max_token_len_per_gpu``, verl's keys); default: the
        training one's.
    """

    prefix = "actor_rollout_ref.actor"

    def __init__(
        self,
        engine: MegatronEngine,
        config: ActorConfig,
        *,
        rollout_n: int,
        log_prob_micro_batch_size: int | None = None,
        log_prob_use_dynamic_bsz: bool | None = None,
        log_prob_max_token_len: int | None = None,
        distillation: DistillationLossConfig | None = None,
    ) -> None:
        if not engine.trainable:
            raise ValueError(
                "ActorRole needs a trainable MegatronEngine (built with the actor's optim config)"
            )
        if engine.value_head:
            raise ValueError("ActorRole needs a causal-LM engine, got a value-head (critic) engine")
        self.engine = engine
        self.config = config
        self.policy_loss = get_policy_loss(config.policy_loss)
        self.loss_config = PolicyLossConfig.from_actor_config(config)
        self.schedule = UpdateSchedule.create(
            self.prefix,
            config.ppo_mini_batch_size,
            rollout_n,
            config.ppo_epochs,
            config.shuffle,
            config.megatron.seed,
        )
        self.train_spec = MicroBatchSpec(
            config.ppo_micro_batch_size_per_gpu, config.use_dynamic_bsz, config.ppo_max_token_len_per_gpu
        )
        self.log_prob_spec = MicroBatchSpec(
            log_prob_micro_batch_size or config.ppo_micro_batch_size_per_gpu,
            config.use_dynamic_bsz if log_prob_use_dynamic_bsz is None else log_prob_use_dynamic_bsz,
            log_prob_max_token_len or config.ppo_max_token_len_per_gpu,
        )
        # the key a too-long row is named by
        self.log_prob_budget_key = ("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu" if log_prob_max_token_len
                                    else f"{self.prefix}.ppo_max_token_len_per_gpu")
        self.updates_done = 0
        self.distillation = distillation  # on-policy distillation's loss (distillation.distillation_loss), or None

    # ------------------------------------------------------------------ forward only
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """{"old_log_probs", "entropys"}: [B, R] fp32 for the response tokens (0 on response padding)."""
        check_batch(data, (), "compute_log_prob")
        temperature = read_temperature(data, "compute_log_prob")
        self.engine.offload.enter("compute")
        mode = replay_mode(self.config.megatron, f"{self.prefix}.megatron")
        if mode == "R3":
            require_routed_experts(data, mode, "compute_log_prob")
        record = mode == "R2" and ROUTED_EXPERTS not in data.batch  # R2: this pass's routing, replayed in the update
        with recording_routing(self.engine) if record else contextlib.nullcontext() as recorder:
            out = compute_log_probs(
                self.engine,
                data,
                self.log_prob_spec,
                temperature,
                True,
                self.log_prob_budget_key,
            )
        result = {"old_log_probs": out["log_probs"], "entropys": out["entropy"]}
        if record:
            result[ROUTED_EXPERTS] = recorded_routed_experts(self.engine, recorder, data)
        return DataProto.from_dict(result)

    # ------------------------------------------------------------------ update
    def _update_fields(self) -> tuple[str, ...]:
        fields = ["response_mask", "old_log_probs", "advantages"]
        if self.config.use_kl_loss:
            fields.append("ref_log_prob")
        if self.config.tis_imp_ratio_cap is not None or self.config.policy_loss == "decoupled_ppo":
            fields.append("rollout_log_probs")  # the behaviour policy's, which decoupled PPO weights against
        if self.distillation is not None:  # the teacher's scores of the tokens (workers/teacher.py)
            fields += [TOPK_IDS, TOPK_LOG_PROBS] if self.distillation.uses_topk else [TEACHER_LOG_PROBS]
        return tuple(fields)

    def _policy_step(
        self,
        global_batch: GlobalBatchInfo,
        temperature: float,
        logits: torch.Tensor,
        micro_batch: PackedMicroBatch,
    ) -> tuple[torch.Tensor, StepMetrics]:
        cfg, fields = self.config, micro_batch.fields
        mask = fields["response_mask"]
        log_probs, entropy = response_log_probs(
            self.engine, logits, micro_batch, temperature, with_entropy=True
        )
        pg_loss, pg_metrics = self.policy_loss(
            fields["old_log_probs"],
            log_probs,
            fields["advantages"],
            mask,
            cfg.loss_agg_mode,
            self.loss_config,
            fields.get("rollout_is_weights"),
            rollout_log_probs=fields.get("rollout_log_probs"),
            global_batch=global_batch,
        )
        entropy_loss = compute_entropy_loss(entropy, mask, cfg.loss_agg_mode, global_batch)
        totals = {"actor/pg_loss": pg_loss.item(), "actor/entropy": entropy_loss.item()}
        token_means = dict(pg_metrics)
        policy_loss = pg_loss
        if self.distillation is not None:  # on-policy distillation: the loss against the teacher's scores
            policy_loss, distilled = self._distillation_loss(global_batch, temperature, logits, micro_batch,
                                                             log_probs, pg_loss)
            totals["distillation/loss"] = distilled.pop("distillation/loss")  # a share of the mini-batch's loss
            token_means |= distilled
        loss = policy_loss - cfg.entropy_coeff * entropy_loss if cfg.entropy_coeff else policy_loss
        if cfg.use_kl_loss:
            kl_loss = compute_kl_loss(
                log_probs, fields["ref_log_prob"], mask, cfg.kl_loss_type, cfg.loss_agg_mode, global_batch
            )
            loss = loss + cfg.kl_loss_coef * kl_loss
            totals["actor/kl_loss"] = kl_loss.item()
        return loss, StepMetrics(float(mask.sum()), totals, token_means)

    def _distillation_loss(self, global_batch: GlobalBatchInfo, temperature: float, logits: torch.Tensor,
                           micro_batch: PackedMicroBatch, log_probs: torch.Tensor,
                           task_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The distillation loss of the micro-batch against the teacher's scores, combined with the task-reward
        policy loss as ``distillation.distillation_loss.use_task_rewards`` says (verl's distillation_ppo_loss).
        Its metrics (verl's names) are token-weighted means over the mini-batch; the per-micro-batch extremes
        (``_min`` / ``_max``) are left out, as a mean of them would mean nothing."""
        fields, config = micro_batch.fields, self.distillation
        student_logits = None
        if config.uses_topk:  # the student's whole distribution at each response token, [b, R, V/tp]
            student_logits = micro_batch.scatter(micro_batch.select_predictors(logits).float() / temperature)
        loss, metrics = compute_distillation_loss(
            config, fields["response_mask"], self.config.loss_agg_mode, student_log_probs=log_probs,
            teacher_log_probs=fields.get(TEACHER_LOG_PROBS), student_logits=student_logits,
            teacher_topk_ids=fields.get(TOPK_IDS), teacher_topk_log_probs=fields.get(TOPK_LOG_PROBS),
            old_log_probs=fields["old_log_probs"], rollout_is_weights=fields.get("rollout_is_weights"),
            global_batch=global_batch, tp_group=self.engine.tp_group, vocab_size=self.engine.hf_config.vocab_size)
        loss, metrics = combine_with_task_loss(config, loss, metrics, task_loss)
        return loss, {k: v for k, v in metrics.items() if not k.endswith(("_min", "_max"))}

    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches; one optimizer step each, one LR-schedule step per call.

        Returns ``DataProto(meta_info={"metrics": {...}})`` with actor/pg_loss, actor/pg_clipfrac,
        actor/pg_clipfrac_lower, actor/ppo_kl, actor/entropy, [actor/kl_loss, actor/kl_coef],
        actor/grad_norm, actor/lr: means over the optimizer steps, identical on every rank.
        """
        fields = self._update_fields()
        if "rollout_is_weights" in data.batch:  # algorithm.rollout_correction (algos/rollout_corr.py)
            fields += ("rollout_is_weights",)
        check_batch(data, fields, "update_actor")
        mode = replay_mode(self.config.megatron, f"{self.prefix}.megatron")
        if mode != "disabled":
            require_routed_experts(data, mode, "update_actor")
        temperature = read_temperature(data, "update_actor")
        self.engine.offload.enter("update")
        steps = []
        for mini_batch in self.schedule.mini_batches(data, self.updates_done, "update_actor"):
            metrics, grad_norm = train_mini_batch(
                self.engine,
                mini_batch,
                self.train_spec,
                fields,
                lambda global_batch: functools.partial(self._policy_step, global_batch, temperature),
                f"{self.prefix}.ppo_max_token_len_per_gpu",
            )
            router = {f"actor/{name}": value  # MoE router losses, the MTP loss
                      for name, value in (self.engine.router_metrics | self.engine.mtp_metrics).items()}
            steps.append(metrics | {"actor/grad_norm": grad_norm} | router)
        metrics = mean_over_steps(steps) | {"actor/lr": self.engine.lr}
        if self.config.use_kl_loss:
            metrics["actor/kl_coef"] = self.config.kl_loss_coef
        self.engine.scheduler_step()
        self.updates_done += 1
        self.engine.offload.enter("after_update")
        return DataProto(meta_info={"metrics": metrics})

    # ------------------------------------------------------------------ weights
    def export_buckets(self, plan: ExportPlan = ExportPlan()) -> Iterator[WeightBucket]:
        """Every weight under its HF name, in sealed buckets as ``plan`` says; a collective over the
        model-parallel group that every rank must consume to the end (``weights.export_hf_buckets``)."""
        self.engine.offload.enter("compute")
        yield from export_hf_buckets(self.engine.model, plan)
