"""TeacherRole: the teacher of on-policy distillation scores the student's responses (docs/distillation.md).

A frozen ``MegatronEngine`` of the teacher's checkpoint, on the actor's ranks and layout (as the reference). One
forward pass over the student's batch gives, at every response token, what the distillation loss reads
(algos/distillation.py): for ``forward_kl_topk`` the teacher's top-k token ids and their log-probs
(``teacher_topk_ids`` / ``teacher_topk_log_probs`` [B, R, k], taken over the vocabulary split across TP ranks
without gathering it), for the estimator modes (k1, k3, ...) the log-prob of the token the student sampled
(``teacher_log_probs`` [B, R]). The student's sampling temperature applies to the teacher's logits too, as verl's
teacher does.
"""

from __future__ import annotations

import torch

from megatron_rl.algos.distillation import DistillationLossConfig, teacher_topk
from megatron_rl.config.schema import RefConfig
from megatron_rl.protocol import DataProto
from megatron_rl.workers.batch_checks import check_batch, read_temperature
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.forward import compute_log_probs, forward_per_token
from megatron_rl.workers.micro_batches import MicroBatchSpec
from megatron_rl.workers.packing import PackedMicroBatch

TOPK_IDS, TOPK_LOG_PROBS, LOG_PROBS = "teacher_topk_ids", "teacher_topk_log_probs", "teacher_log_probs"


class TeacherRole:
    """``engine``: frozen (no optim); ``loss``: ``distillation.distillation_loss``; ``config``: the reference's
    log-prob micro-batching (``actor_rollout_ref.ref``), which the teacher's pass shares."""

    prefix = "distillation.teacher_models"

    def __init__(self, engine: MegatronEngine, loss: DistillationLossConfig, config: RefConfig) -> None:
        if engine.trainable or engine.value_head:
            raise ValueError("TeacherRole needs a frozen causal-LM MegatronEngine (built without an optim config)")
        self.engine, self.loss = engine, loss
        self.spec = MicroBatchSpec(config.log_prob_micro_batch_size_per_gpu, config.log_prob_use_dynamic_bsz,
                                   config.log_prob_max_token_len_per_gpu)
        self.budget_key = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"

    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        """The teacher's side of the distillation loss for each response token (0 on response padding)."""
        check_batch(data, (), "compute_teacher_log_prob")
        temperature = read_temperature(data, "compute_teacher_log_prob")
        self.engine.offload.enter("compute")
        if not self.loss.uses_topk:
            out = compute_log_probs(self.engine, data, self.spec, temperature, False, self.budget_key)
            return DataProto.from_dict({LOG_PROBS: out["log_probs"]})
        k = int(self.loss.topk)
        engine = self.engine

        def per_token(logits: torch.Tensor, micro_batch: PackedMicroBatch) -> dict[str, torch.Tensor]:
            predictors = micro_batch.select_predictors(logits).float() / temperature
            ids, log_probs = teacher_topk(predictors, k, tp_group=engine.tp_group,
                                          vocab_size=engine.hf_config.vocab_size)
            return {TOPK_IDS: micro_batch.scatter(ids.float()), TOPK_LOG_PROBS: micro_batch.scatter(log_probs)}

        out = forward_per_token(engine, data, self.spec, per_token, (TOPK_IDS, TOPK_LOG_PROBS), self.budget_key,
                                widths={TOPK_IDS: k, TOPK_LOG_PROBS: k})
        return DataProto.from_dict({TOPK_IDS: out[TOPK_IDS].long(), TOPK_LOG_PROBS: out[TOPK_LOG_PROBS]})


class EngineTeacher:
    """The teacher served by an HF engine (``distillation.teacher_models.<name>.inference.name=hf``): a transformers
    model of the teacher's checkpoint on each rollout replica's leader, scoring that replica's share of the batch
    (ROLLOUT_COMPUTE_PROTO). Its layout is the rollout mesh's (one whole copy per replica), not the actor's: the
    teacher of a TP2 actor may be two TP1 replicas. Same outputs as ``TeacherRole``."""

    def __init__(self, model_path: str, loss: DistillationLossConfig, device: torch.device, dtype: torch.dtype,
                 rows_per_forward: int) -> None:
        from transformers import AutoModelForCausalLM  # the HF engine's model classes, on the leaders only

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        self.loss, self.device, self.rows = loss, device, max(int(rows_per_forward), 1)

    @torch.no_grad()
    def compute_teacher_log_prob(self, data: DataProto) -> DataProto:
        check_batch(data, (), "compute_teacher_log_prob")
        temperature = read_temperature(data, "compute_teacher_log_prob")
        width = data.batch["responses"].shape[1]
        parts: dict[str, list[torch.Tensor]] = {}
        for start in range(0, len(data), self.rows):
            rows = {k: data.batch[k][start:start + self.rows].to(self.device)
                    for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
            logits = self.model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                                position_ids=rows["position_ids"]).logits[:, -width - 1:-1]
            log_probs = torch.log_softmax(logits.float() / temperature, dim=-1)
            keep = rows["response_mask"].bool()
            if self.loss.uses_topk:
                top = torch.topk(log_probs, int(self.loss.topk), dim=-1)
                scores = {TOPK_IDS: top.indices * keep[..., None], TOPK_LOG_PROBS: top.values * keep[..., None]}
            else:
                scores = {LOG_PROBS: log_probs.gather(-1, rows["responses"][..., None])[..., 0] * keep}
            for name, value in scores.items():
                parts.setdefault(name, []).append(value.cpu())
        return DataProto.from_dict({name: torch.cat(values) for name, values in parts.items()})
