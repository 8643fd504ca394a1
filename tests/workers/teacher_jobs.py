"""Spawned jobs of tests/workers/test_distillation_roles.py: the teacher's scores and one distillation update of the
actor, at TP1 and TP2, returned as plain tensors."""

from __future__ import annotations

from typing import Any

import torch
from workers_batches import make_rl_batch

from megatron_rl.algos.distillation import DistillationLossConfig
from megatron_rl.config.schema import ActorConfig, MegatronParallelConfig, OptimConfig, RefConfig
from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
from megatron_rl.protocol import DataProto

ROWS, LR, TEMPERATURE, TOPK = 8, 1e-2, 0.7, 8
LOSSES = {"topk": DistillationLossConfig(loss_mode="forward_kl_topk", topk=TOPK, use_task_rewards=False),
          "k3": DistillationLossConfig(loss_mode="k3", use_task_rewards=False)}


def batch() -> DataProto:
    return make_rl_batch(ROWS, seed=3, temperature=TEMPERATURE)


def scores_and_update(student: str, teacher: str, tp: int, mode: str) -> dict[str, Any]:
    from megatron_rl.weights.export import ExportPlan, export_hf_buckets
    from megatron_rl.workers import ActorRole, MegatronEngine
    from megatron_rl.workers.teacher import TeacherRole

    init_model_parallel(tp=tp)
    layout, loss = MegatronParallelConfig(tensor_model_parallel_size=tp), LOSSES[mode]
    role = TeacherRole(MegatronEngine(teacher, layout, None), loss, RefConfig(log_prob_micro_batch_size_per_gpu=3))
    data = batch()
    scores = role.compute_teacher_log_prob(data)
    config = ActorConfig(ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=3, entropy_coeff=0.0,
                         optim=OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1e9), megatron=layout)
    actor = ActorRole(MegatronEngine(student, layout, config.optim), config, rollout_n=1, distillation=loss)
    data.batch["old_log_probs"] = actor.compute_log_prob(data).batch["old_log_probs"]
    metrics = actor.update_actor(data.union(scores)).meta_info["metrics"]
    weights = {name: t.clone() for bucket in export_hf_buckets(actor.engine.model, ExportPlan())
               for name, t in bucket.named_tensors()}
    destroy_model_parallel()
    return {"scores": dict(scores.batch.items()), "metrics": metrics, "weights": weights}


def one_rank_job(student: str, teacher: str) -> dict[str, Any]:
    return {mode: scores_and_update(student, teacher, 1, mode) for mode in LOSSES}


def two_rank_job(student: str, teacher: str) -> dict[str, Any]:
    return {mode: scores_and_update(student, teacher, 2, mode) for mode in LOSSES}
