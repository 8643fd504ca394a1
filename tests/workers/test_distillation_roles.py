"""On-policy distillation on the workers (workers/teacher.py, the actor's distillation loss): the teacher's top-k
ids and log-probs and its log-prob of the sampled token equal transformers' at TP1 and TP2 (the vocabulary split
over TP ranks); the actor's update with forward_kl_topk and with k3 has the loss, the gradient norm and the weights
after one Adam step of the same loss computed on the transformers student (algos/distillation.py on its logits).
The teacher is another model than the student (3 layers, 48 wide, its own weights), the student a 2-layer 32-wide
one, both with perturbed norms and biases; sampling temperature 0.7.

Tolerances as tests/workers/test_workers_roles.py: log-probs 1e-5, loss and gradient norm relative 1e-4, weights
after one Adam step 1e-3.
"""

from __future__ import annotations

import pytest
import teacher_jobs as jobs
import torch

from megatron_rl.algos.distillation import compute_distillation_loss
from megatron_rl.distributed import run_multiprocess

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("distill")
    student = make_tiny_hf_checkpoint(root / "student", "qwen2", with_tokenizer=False)
    teacher = make_tiny_hf_checkpoint(root / "teacher", "qwen2", with_tokenizer=False, seed=3, num_layers=3,
                                      hidden_size=48, intermediate_size=96)
    return str(student), str(teacher)


@pytest.fixture(scope="module")
def one_rank(models):
    return run_multiprocess(jobs.one_rank_job, 1, *models, timeout_s=400)[0]


@pytest.fixture(scope="module")
def two_ranks(models):
    return run_multiprocess(jobs.two_rank_job, 2, *models, timeout_s=400)[0]


def response_logits(model_dir: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """The transformers model and its temperature-scaled logits at the positions predicting each response token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = jobs.batch()
    width = data.batch["responses"].shape[1]
    logits = model(input_ids=data.batch["input_ids"], attention_mask=data.batch["attention_mask"],
                   position_ids=data.batch["position_ids"]).logits
    return model, logits[:, -width - 1:-1].float() / jobs.TEMPERATURE


@pytest.fixture(scope="module")
def oracle(models) -> dict:
    student_dir, teacher_dir = models
    data = jobs.batch()
    mask = data.batch["response_mask"]
    with torch.no_grad():
        teacher = torch.log_softmax(response_logits(teacher_dir)[1], -1)
    top = torch.topk(teacher, jobs.TOPK, dim=-1)
    sampled = teacher.gather(-1, data.batch["responses"][..., None])[..., 0]
    out = {"topk_ids": top.indices, "topk_log_probs": top.values, "teacher_log_probs": sampled, "mask": mask}
    for mode, loss_config in jobs.LOSSES.items():
        model, logits = response_logits(student_dir)
        student = torch.log_softmax(logits, -1).gather(-1, data.batch["responses"][..., None])[..., 0]
        loss, _ = compute_distillation_loss(loss_config, mask, student_log_probs=student, teacher_log_probs=sampled,
                                            student_logits=logits, teacher_topk_ids=top.indices,
                                            teacher_topk_log_probs=top.values)
        loss.backward()
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
        torch.optim.Adam(model.parameters(), lr=jobs.LR, betas=(0.9, 0.999), eps=1e-8).step()
        out[mode] = {"loss": loss.item(), "grad_norm": norm,
                     "weights": {n: p.detach().clone() for n, p in model.named_parameters()}}
    return out


def check(result: dict, oracle: dict, where: str) -> None:
    mask = oracle["mask"].bool()
    scores = result["topk"]["scores"]
    assert torch.equal(scores["teacher_topk_ids"][mask], oracle["topk_ids"][mask]), where
    torch.testing.assert_close(scores["teacher_topk_log_probs"][mask], oracle["topk_log_probs"][mask], atol=1e-5,
                               rtol=0)
    torch.testing.assert_close(result["k3"]["scores"]["teacher_log_probs"][mask], oracle["teacher_log_probs"][mask],
                               atol=1e-5, rtol=0)
    for mode in jobs.LOSSES:
        metrics, want = result[mode]["metrics"], oracle[mode]
        assert metrics["distillation/loss"] == pytest.approx(want["loss"], rel=1e-4), (where, mode)
        assert metrics["actor/grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), (where, mode)
        for name, tensor in result[mode]["weights"].items():
            torch.testing.assert_close(tensor, want["weights"][name], atol=1e-3, rtol=0, msg=f"{where} {mode} {name}")


def test_teacher_scores_and_distillation_update_at_tp1(one_rank, oracle):
    check(one_rank, oracle, "tp1")


def test_teacher_scores_and_distillation_update_at_tp2(two_ranks, oracle):
    check(two_ranks, oracle, "tp2")


def test_the_topk_metrics_are_reported(one_rank):
    metrics = one_rank["topk"]["metrics"]
    for name in ("distillation/student_mass", "distillation/teacher_mass", "distillation/overlap_ratio"):
        assert 0.0 <= metrics[name] <= 1.0, name
    assert "distillation/abs_loss" in one_rank["k3"]["metrics"]


def test_the_engine_served_teacher_scores_as_the_megatron_teacher(models, oracle, one_rank):
    """inference.name=hf: the transformers teacher on a rollout leader (3 rows per forward) gives the same top-k and
    sampled-token log-probs as the oracle and the Megatron teacher."""
    from megatron_rl.workers.teacher import EngineTeacher

    mask = oracle["mask"].bool()
    for mode, loss in jobs.LOSSES.items():
        scores = EngineTeacher(models[1], loss, torch.device("cpu"), torch.float32, 3).compute_teacher_log_prob(
            jobs.batch()).batch
        megatron = one_rank[mode]["scores"]
        for name in megatron:
            assert scores[name].dtype == megatron[name].dtype, name
            torch.testing.assert_close(scores[name][mask], megatron[name][mask], atol=1e-5, rtol=0, msg=name)
            assert not scores[name][~mask].any(), name  # 0 on response padding, as the Megatron teacher's
        if loss.uses_topk:
            assert torch.equal(scores["teacher_topk_ids"][mask], oracle["topk_ids"][mask])
